"""
The SFT-continued control for RL: SFT continued from the SFT model that RL started from, on the same
demonstrations with SFT's own learning-rate schedule, for as many training seconds as the RL run took (its
log's seconds; evaluations excluded on both sides). It evaluates where the RL run did: at the seconds the RL
run had trained when it reached each of its evaluations, so the two curves share an x-axis, the RL step.

    python -m lab.control [the RL run's flags]

Writes its own run folder, the RL run's name + "_sft-continued": log.jsonl (step: the RL step with the same
training seconds; sft_step; seconds; progress accuracy and reward), ckpt.pt (the last model), run.json, and
with --final-eval-size N final.json. It is a weak control by construction: on 500 demonstrations SFT kept its
model where validation stopped improving, and more SFT memorises them. Rejection-sampling fine-tuning
(python -m lab.rl --advantages rft) is the fair one.
"""
import json
import os
import time

import torch

import bgpo
from bgpo import SFT_LR, test_problems, load_checkpoint, load_model, sft_batches, sft_lr_at, sft_path
from lab import cli
from lab.rl import final_evaluation, sft_step
from lab.sampler import evaluate
from tasks import get_task

def control_dir(args):
    return os.path.join(args.out_dir, args.run_name + "_sft-continued")

def run_control(args, task):
    records = [json.loads(line) for line in open(os.path.join(args.out_dir, args.run_name, "log.jsonl"))]
    elapsed, when = 0.0, []   # when: (the RL run's training seconds at an evaluation, its step)
    for r in records:
        elapsed += r.get("seconds", 0.0)
        if "accuracy" in r and r["step"] > 0:
            when.append((elapsed, r["step"]))
    budget = elapsed
    start = step = load_checkpoint(sft_path(args), task)["step"]
    model = load_model(sft_path(args), task, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.01)
    generator, test_prompts = torch.Generator().manual_seed(args.seed + 2), test_problems(task, args)
    batches, spent = sft_batches(task, args, generator), 0.0
    out = control_dir(args)
    os.makedirs(out, exist_ok=True)
    if os.path.isfile(os.path.join(out, "final.json")):
        os.remove(os.path.join(out, "final.json"))   # the replaced control's score
    cli.write_json(os.path.join(out, "run.json"), cli.describe_run(args))
    result = evaluate(model, task, test_prompts, args)
    print(f"control: SFT continued from step {start} for the {budget:.0f} s of training that "
          f"{args.run_name} took\n"
          f"RL step    0 (SFT step {step:5d}) | progress accuracy {result['accuracy']:5.1%} "
          f"(reward {result['reward']:.3f}) | 0 s")
    curve = [{"step": 0, "sft_step": step, "seconds": 0.0, "accuracy": result["accuracy"],
              "reward": result["reward"]}]
    while when:
        t0, step = time.time(), step + 1
        sft_step(model, optimizer, *next(batches), sft_lr_at(args, step), generator)
        spent += time.time() - t0
        if spent >= when[0][0]:  # the RL run had trained this long at its next evaluation
            result, rl_step = evaluate(model, task, test_prompts, args), when.pop(0)[1]
            curve.append({"step": rl_step, "sft_step": step, "seconds": spent, "accuracy": result["accuracy"],
                          "reward": result["reward"]})
            print(f"RL step {rl_step:4d} (SFT step {step:5d}) | progress accuracy {result['accuracy']:5.1%} "
                  f"(reward {result['reward']:.3f}) | {spent:.0f} s")
    with open(os.path.join(out, "log.jsonl.tmp"), "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in curve)
    os.replace(os.path.join(out, "log.jsonl.tmp"), os.path.join(out, "log.jsonl"))
    bgpo.save_checkpoint(os.path.join(out, "ckpt.pt"), task, model.config, stage="sft-continued", step=step,
                         model=model.state_dict())
    rl = [r for r in records if "accuracy" in r]
    for name, accuracy in (("SFT model", curve[0]["accuracy"]),
                           (f"SFT continued, {step - start} steps", curve[-1]["accuracy"]),
                           (f"SFT + RL, {rl[-1]['step']} RL steps", rl[-1]["accuracy"])):
        print(f"{name:>32} {accuracy:>6.1%}")
    if args.final_eval_size:
        final_evaluation(model, task, args, out, curve[-1]["step"])
    print(f"written to {out}")
    return curve

def main(argv=None):
    p = cli.make_parser("python -m lab.control", __doc__.strip().split("\n\n")[0])
    p.add_argument("--final-eval-size", type=int, default=0,
                   help="test problems on which the SFT model and the last one are scored (final.json)")
    p.add_argument("--pass-at-k-size", type=int, default=0,
                   help="of those, the first N also get pass@k, as python -m lab.rl's (final.json); 0: none")
    args = cli.check_args(p, p.parse_args(argv))
    log = os.path.join(args.out_dir, args.run_name, "log.jsonl")
    if not os.path.isfile(log):
        p.error(f"the control runs for as long as the RL run did: no RL log at {log}")
    if os.path.isfile(os.path.join(control_dir(args), "log.jsonl")) and not args.overwrite:
        p.error(f"{control_dir(args)} holds a control already: --overwrite replaces it")
    task = get_task(args.task)
    print(f"task {task.name} | device {args.device} | seed {args.seed}")
    return run_control(args, task)

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.control")
