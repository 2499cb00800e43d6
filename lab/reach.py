"""
The reach of a model: pass@k for k up to 128, from 128 samples of each test problem, with each sampler
(LLaDA's confidence order, or a uniformly random order: the random-order model that the ELBO bounds) at
each temperature. Greedy accuracy says what the policy writes; pass@k says what it can write in k tries,
the ceiling that RL by sampling and reweighting reaches first.

    python -m lab.reach --seed 10 [--problems 100] [--samples 128] [any bgpo.py flag]

The model is bgpo.py's SFT model of the flags (trained first if absent), or --model PATH. The problems are
the first --problems of the final evaluation's test problems (lab.rl --final-eval-size's). Each
(sampler, temperature) draws from a generator seeded alike, so the samplers differ by their order alone.
Beside pass@k: the model's greedy accuracy and its policy's entropy on the same problems, and with
--reference (an SFT model's --json) its new solves, the problems it answers right greedily that the
reference never solved in its samples at the rollout temperature: reach that sampling more widely from the
reference could not have faked.

    python -m lab.reach --seed 10 --json sft.json
    python -m lab.reach --seed 10 --model RUN/ckpt.pt --reference sft.json

--samplers low_confidence measures LLaDA's sampler alone, in half the seconds (new solves need no other).
With --reference it also splits the reach not turned into answers: the problems solved in the samples at
each temperature but not greedily, by the greedy answer's reward (0: malformed; above 0: a wrong answer, or
on Sudoku a partly right grid), and how many of them the reference ever solved at that temperature.
"""
import json
import argparse
import time

import torch

import bgpo
from lab import cli, rl
from tasks import get_task

SAMPLERS = (("low_confidence", 1.3), ("low_confidence", 1.0), ("random", 1.0), ("random", 1.3))

def solves(model, task, prompts, n_samples, args, remasking, temperature):
    """Per prompt, how many of its n_samples samples by this sampler at this temperature solve it (8 prompts
    a call: 1,024 rollouts at 128 samples)."""
    args = argparse.Namespace(**{**vars(args), "temperature": temperature})
    generator = torch.Generator().manual_seed(args.seed + 3)
    return rl.solve_counts(model, task, prompts, n_samples, args, generator, per_call=8, remasking=remasking)

def main(argv=None):
    p = cli.make_parser("python -m lab.reach",
                        "pass@k up to 128 of an SFT model, per sampler and temperature.")
    p.add_argument("--problems", type=int, default=100, help="test problems")
    p.add_argument("--samples", type=int, default=128, help="samples per problem (the largest k)")
    p.add_argument("--model", default=None, help="a checkpoint to measure (None: the SFT model of the flags)")
    p.add_argument("--json", default=None, help="write the table here as JSON")
    p.add_argument("--reference", default=None,
                   help="another model's --json (its SFT model's): count this model's new solves against it")
    p.add_argument("--samplers", default="low_confidence,random",
                   help="the unmasking orders to sample with, of low_confidence and random")
    args = cli.check_args(p, p.parse_args(argv))
    if args.problems < 1 or args.samples < 1:
        p.error(f"--problems and --samples must be >= 1, got {args.problems} and {args.samples}")
    orders = args.samplers.split(",")
    if any(order not in ("low_confidence", "random") for order in orders):
        p.error(f"--samplers must name low_confidence and/or random, got {args.samplers!r}")
    task = get_task(args.task)
    model = bgpo.load_model(args.model, task, args) if args.model else bgpo.sft_model(args, task)
    prompts = task.sample(args.problems, "test", 1234)[0]   # draws in order: final.json's first problems
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= args.samples]
    print(f"pass@k (%) on {len(prompts)} test problems, {args.samples} samples each, seed {args.seed}")
    print(f"{'sampler':<16} {'T':>4} " + " ".join(f"{'@' + str(k):>6}" for k in ks)
          + "  never  always  seconds")
    table = []
    for remasking, temperature in [sampler for sampler in SAMPLERS if sampler[0] in orders]:
        t0 = time.time()
        counts = solves(model, task, prompts, args.samples, args, remasking, temperature)
        values = [sum(rl.pass_at_k(args.samples, c, k) for c in counts) / len(counts) for k in ks]
        never = sum(c == 0 for c in counts) / len(counts)
        always = sum(c == args.samples for c in counts) / len(counts)
        table.append({"remasking": remasking, "temperature": temperature, "pass_at_k": dict(zip(ks, values)),
                      "never": never, "always": always, "solves": counts, "seconds": time.time() - t0})
        print(f"{remasking:<16} {temperature:>4} " + " ".join(f"{100 * v:6.1f}" for v in values)
              + f"  {100 * never:5.1f}  {100 * always:6.1f}  {time.time() - t0:7.0f}", flush=True)
    with torch.no_grad():   # the greedy answers, as bgpo.evaluate writes them, with their rewards
        x = bgpo.encode(task, prompts, device=args.device)
        answers = [task.decode(y) for y in bgpo.generate(model, x, task.gen_len).cpu()]
    greedy_reward = [task.reward(prompt, answer) for prompt, answer in zip(prompts, answers)]
    greedy = [int(r == 1.0) for r in greedy_reward]
    entropy = rl.policy_entropy(model, task, prompts, args)
    print(f"greedy accuracy {sum(greedy) / len(greedy):.1%}, policy entropy {entropy:.3f} nats per position")
    new, unconverted = None, {}
    if args.reference:
        reference = json.load(open(args.reference))
        new = new_solves(greedy, reference, bgpo.TEMPERATURE)
        print(f"new solves: {sum(new)} of {len(new)} problems ({sum(new) / len(new):.1%}), answered right "
              f"greedily here, never solved by {args.reference}'s samples at temperature {bgpo.TEMPERATURE}")
        for row in (r for r in table if r["remasking"] == "low_confidence"):
            split = unconverted[str(row["temperature"])] = reach_not_answered(greedy_reward, row, reference)
            print(f"at T {row['temperature']}: {split['reached']} problems solved in the samples but not "
                  f"greedily: {split['malformed']} malformed greedy answers, {split['wrong']} wrong; "
                  f"{split['reference_reached']} of them solved by the reference's samples")
    if args.json:
        cli.write_json(args.json, {"seed": args.seed, "problems": len(prompts), "samples": args.samples,
                                   "table": table, "greedy": greedy, "greedy_reward": greedy_reward,
                                   "entropy": entropy, "new_solves": new, "unconverted": unconverted})
    return table

def new_solves(greedy, reference, temperature):
    """Per problem, 1 if answered right greedily (greedy: 0/1 per problem) and never solved in the reference's
    samples by LLaDA's sampler at this temperature (reference: a --json of this command), else 0."""
    row = next(r for r in reference["table"]
               if (r["remasking"], r["temperature"]) == ("low_confidence", temperature))
    if len(row["solves"]) != len(greedy):
        raise bgpo.RunError(f"the reference scored {len(row['solves'])} problems, this model {len(greedy)}")
    return [int(g == 1 and c == 0) for g, c in zip(greedy, row["solves"])]

def reach_not_answered(greedy_reward, row, reference):
    """The problems of a table row (one sampler and temperature) solved in its samples but not greedily:
    how many, how many of their greedy answers are malformed (reward 0) or wrong (between 0 and 1), and how
    many of them the reference (a --json of this command) solved in its samples of that sampler and
    temperature."""
    ref = next(r for r in reference["table"] if (r["remasking"], r["temperature"]) ==
               (row["remasking"], row["temperature"]))
    rows = [i for i, (g, c) in enumerate(zip(greedy_reward, row["solves"])) if c > 0 and g < 1]
    return {"reached": len(rows), "malformed": sum(greedy_reward[i] == 0 for i in rows),
            "wrong": sum(0 < greedy_reward[i] < 1 for i in rows),
            "reference_reached": sum(ref["solves"][i] > 0 for i in rows)}

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.reach")
