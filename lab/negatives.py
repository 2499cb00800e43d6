"""
What each half of BGPO's update does to the likelihood of the completions it acts on, measured exactly.

Where A > 0 the update raises the ELBO of a completion, a lower bound of log pi(y|x): the likelihood is
pushed up from below. Where A < 0 it lowers the ELBO, which guarantees nothing about the likelihood: the
ELBO is the mean over unmasking orders of each order's log-likelihood, log pi the log of the mean of their
likelihoods, so an update can lower the ELBO through orders that carry almost none of the probability.
SPG (Wang et al., arXiv 2510.09541) makes this argument. Completions of Countdown have L = 10 tokens, so the
lab can compute both exactly (lab/estimators.py, over the 2^L mask sets) and see what happens.

For each seed's SFT model and rollout batch (the first is the default RL run's first batch), one update on
the negative-advantage rows alone and, separately, one on the positive rows alone: the first step of the
default optimizer (AdamW at --rl-lr with fresh moments, as RL step 1 takes without warmup: it moves every
weight by about --rl-lr, whatever its gradient's size), and a small gradient step (the half's gradient,
scaled to --small-step in parameter norm, where the first-order picture holds). Measured on every
completion of the first --groups groups that carry a signal, before and after, per token (/ L):
- the random-order model's log-likelihood log E_sigma p_sigma(y|x), exactly;
- the ELBO, E_sigma log p_sigma(y|x), exactly; and the gap between them (>= 0, Jensen);
- how often the rollouts' sampler (LLaDA's low-confidence sampler at --temperature) writes the completion
  again, from --sampler-draws fresh draws of its prompt (the default step only: a small step's change is
  below that count's resolution).

    python -m lab.negatives [--seeds 0-2] [--batches 2] [--groups 2] [--sampler-draws 500] [bgpo.py's flags
                            and the lab's common ones: --temperature, --neg-weight, --rl-lr, ...]
    python -m lab.negatives --describe RUN/ckpt.pt [--seed S]   # the same measures of a model's own rollouts
    python -m lab.negatives --track out/RUN_A_seed{seed},out/RUN_B_seed{seed} --seeds 0-4   # whole runs
    python -m lab.negatives --track-logs out/RUN_A_seed{seed},... --seeds 0-4   # every evaluation, drawn

Needs each seed's SFT model (python -m lab.rl --stage sft --seed S). Prints the table: per seed the mean over
its batches, then the mean over seeds with a 95% Student-t interval (the batches of a seed share its SFT
model, so the seeds are the independent units); writes it to negatives.json (--objective spg:
negatives_spg.json) in --out-dir.
"""
import argparse
import copy
import itertools
import math
import os
import time

import torch

import bgpo
from lab import cli, rl
from lab.estimators import exact_table, random_order_from_table, spg_bound_from_table
from lab.objectives import ADVANTAGES, OBJECTIVES, SPG_BETA, SPG_MIX, flat_grad, rows_of
from lab.sampler import generate, sample_rollouts
from lab.figures import draw, read_log
from lab.sweep import band, interval, parse_seeds
from tasks import get_task

HALVES = {"negative": lambda A: A < 0, "positive": lambda A: A > 0}
MEASURES = ("log_likelihood", "elbo", "gap", "spg_bound", "sampler_frequency")

# -----------------------------------------------------------------------------
# The three measures of a completion's likelihood

def exact_measures(model, prompts, completions, beta=SPG_BETA):
    """Per row, exactly, in nats, from one enumeration of its 2^L mask sets (float64 model advised: the small
    step's changes are ~1e-5 nats): {"log_likelihood": log E_sigma p_sigma(y|x), "elbo": E_sigma log
    p_sigma(y|x), "gap": their difference, "spg_bound": SPG's upper bound at beta in expectation over its
    copies}, each (B,)."""
    # exact_table's masks and float64 log-probabilities; its other two tables are not needed here
    tables = [exact_table(model, x, y)[:2] for x, y in zip(prompts, completions)]
    elbo, log_likelihood = (torch.stack(v) for v in zip(*(random_order_from_table(*t) for t in tables)))
    return {"log_likelihood": log_likelihood, "elbo": elbo, "gap": log_likelihood - elbo,
            "spg_bound": torch.stack([spg_bound_from_table(*t, beta) for t in tables])}

@torch.no_grad()
def sampler_frequency(model, prompts, completions, group_size, draws, args, generator, per_call=500):
    """Per row, the share of `draws` fresh samples from its prompt by the rollouts' sampler (lab.sampler's
    generate at --temperature, --gen-steps, --block-len) that equal the row's completion, and its standard
    error sqrt(f (1 - f) / draws): (B,), (B,). Rows come in groups of group_size completions of one prompt,
    which share the draws."""
    freq = []
    for g in range(0, len(prompts), group_size):
        hits = torch.zeros(group_size)
        for n in [per_call] * (draws // per_call) + ([draws % per_call] if draws % per_call else []):
            y = generate(model, prompts[g:g + 1].expand(n, -1), completions.shape[1], steps=args.gen_steps,
                         block_len=args.block_len, temperature=args.temperature, generator=generator)
            hits += (y[None] == completions[g:g + group_size, None]).all(-1).sum(1).cpu()   # (G,)
        freq.append(hits / draws)
    freq = torch.cat(freq).double()
    return freq, (freq * (1 - freq) / draws).sqrt()

def sampler_law(model, prompt, gen_len, temperature):
    """The exact law of lab.sampler.generate(model, prompt, gen_len, temperature=T) with its defaults (one
    token per step, one block, low-confidence remasking), by enumeration: at each step every masked position
    draws a token from softmax(logits / T), and the one whose drawn token is most probable under
    softmax(logits) is committed. -> {completion tuple: probability}. Sums over V^(masked positions) draws
    per state: tiny models and 2-3 tokens only (the test of sampler_frequency)."""
    if not temperature > 0:
        raise ValueError(f"temperature: the law is enumerated for a temperature > 0, got {temperature}")
    mask_id, P = model.config.mask_id, prompt.shape[0]
    law = {}

    def visit(y, prob):
        masked = [i for i in range(gen_len) if y[i] == mask_id]
        if not masked:
            law[tuple(y)] = law.get(tuple(y), 0.0) + prob
            return
        with torch.no_grad():
            logits = model(torch.cat([prompt, torch.tensor(y)])[None]).double()[0, P:][masked]   # (m, V)
        q, p = (logits / temperature).softmax(-1), logits.softmax(-1)
        tokens = [(q[j] > 0).nonzero()[:, 0].tolist() for j in range(len(masked))]
        outcome = {}   # (position, token) committed -> probability
        for draw in itertools.product(*tokens):
            chance = math.prod(q[j, t].item() for j, t in enumerate(draw))
            j = max(range(len(masked)), key=lambda j: p[j, draw[j]].item())
            outcome[masked[j], draw[j]] = outcome.get((masked[j], draw[j]), 0.0) + chance
        for (i, t), chance in outcome.items():
            visit(y[:i] + [t] + y[i + 1:], prob * chance)

    visit([mask_id] * gen_len, 1.0)
    return law

# -----------------------------------------------------------------------------
# One half of the update, one step

def half_gradient(model, batch, state, A, half, args):
    """The half's own part of the update's gradient, left in model's .grad: the rows of one half (A < 0 or
    A > 0), their A scaled by the half's share of the batch, as lab.rl's split_by_sign does, so that the two
    halves add up to the whole update."""
    rows = HALVES[half](A)
    model.zero_grad(set_to_none=True)
    OBJECTIVES[args.objective].backward(model, rows_of(batch, rows), rows_of(state, rows),
                                        A[rows] * int(rows.sum()) / len(A), args, 0)
    return flat_grad(model)

def half_step(model, batch, state, A, half, step, args):
    """A copy of model after one step on one half of the update: "default", AdamW with fresh moments at
    --rl-lr after lab.rl's clip; "small", gradient descent of norm --small-step."""
    stepped = copy.deepcopy(model)
    g = half_gradient(stepped, batch, state, A, half, args)
    if step == "default":
        torch.nn.utils.clip_grad_norm_(stepped.parameters(), 1.0)
        torch.optim.AdamW(stepped.parameters(), lr=args.rl_lr, weight_decay=0.0).step()
    else:
        with torch.no_grad():
            for p in stepped.parameters():
                if p.grad is not None:
                    p -= args.small_step * p.grad / g.norm()
    return stepped

def measure(model, batch, rows, args, generator, sampler=True):
    """The measures of the completions in rows: the exact ones on a float64 copy, then the sampler's."""
    x, y = batch.x[rows].cpu(), batch.y[rows].cpu()
    result = exact_measures(copy.deepcopy(model).double().cpu(), x, y)
    if sampler:
        result["sampler_frequency"] = sampler_frequency(model, batch.x[rows], batch.y[rows], args.group_size,
                                                        args.sampler_draws, args, generator)[0]
    return result

def one_unit(model, task, args, generator):
    """One rollout batch of the SFT model: its rows, and per (half, step size) each measure's change on the
    rows of each sign."""
    G = args.group_size
    prompts = task.sample(args.prompts_per_step, "train", generator)[0]
    batch = sample_rollouts(model, task, prompts, G, args, generator)
    A = rl.advantages(batch.rewards, args)   # lab.rl's, from the task's reward
    state = OBJECTIVES[args.objective].prepare(model, batch, args, generator)
    signal = (A.view(-1, G) != 0).any(1).nonzero()[:, 0][:args.groups]   # the first groups with a signal
    rows = (signal[:, None] * G + torch.arange(G, device=signal.device)).flatten()
    if not len(rows):
        return None
    sign = A[rows].sign().cpu()
    draw_seed = int(torch.randint(2**31, (1,), generator=generator))
    freq_gen = lambda: torch.Generator().manual_seed(draw_seed)   # the same draws before and after
    before = measure(model, batch, rows, args, freq_gen())
    changes = {}
    for half, step in itertools.product(HALVES, ("default", "small")):
        if not HALVES[half](A).any():
            continue
        after = measure(half_step(model, batch, state, A, half, step, args), batch, rows, args, freq_gen(),
                        sampler=step == "default")
        changes[half, step] = {name: after[name] - before[name] for name in after}
    return {"seed": args.seed, "rows": len(rows), "groups": len(signal), "sign": sign, "before": before,
            "changes": changes}

def summarise(units, L):
    """Per (half, step, rows of a sign, measure): each seed's mean change per token over its batches' rows,
    then the mean over seeds with its interval; the shares of rows, pooled, whose measure fell and rose
    (the sampler's frequency is often unchanged: the same draws before and after). The sampler frequency's
    change is per completion, not per token."""
    table, updates = [], sorted({key for unit in units for key in unit["changes"]})
    for (half, step), on, name in itertools.product(updates, ("negative", "positive"), MEASURES):
        per_seed, fell, rose = {}, 0, 0
        for unit in units:
            rows = unit["sign"] < 0 if on == "negative" else unit["sign"] > 0
            if name not in unit["changes"].get((half, step), {}) or not rows.any():
                continue
            change = unit["changes"][half, step][name][rows]
            change = change if name == "sampler_frequency" else change / L
            per_seed.setdefault(unit["seed"], []).append(change)
            fell, rose = fell + int((change < 0).sum()), rose + int((change > 0).sum())
        if not per_seed:
            continue
        mean, half_width = interval([torch.cat(c).mean().item() for c in per_seed.values()])
        n = sum(len(c) for changes in per_seed.values() for c in changes)
        table.append({"update": half, "step": step, "rows": on, "measure": name, "mean": mean,
                      "half_width": half_width, "share_fell": fell / n, "share_rose": rose / n, "n": n,
                      "seeds": len(per_seed), "per_seed": {seed: torch.cat(c).mean().item()
                                                           for seed, c in per_seed.items()}})
    return table

def describe(path, task, args, n_prompts=2):
    """The measures of the completions a checkpoint's model writes itself: G rollouts of each of the first
    n_prompts test problems, each with its reward, its exact log-likelihood, ELBO and gap per token, and
    how often the sampler writes it. Prints one line per completion; returns the rows."""
    model = bgpo.load_model(path, task, args)
    batch = sample_rollouts(model, task, bgpo.test_problems(task, args)[:n_prompts], args.group_size, args,
                            torch.Generator().manual_seed(args.seed + 4))
    exact = exact_measures(copy.deepcopy(model).double().cpu(), batch.x.cpu(), batch.y.cpu())
    freq, se = sampler_frequency(model, batch.x, batch.y, args.group_size, args.sampler_draws, args,
                                 torch.Generator().manual_seed(args.seed + 5))
    L, rows = task.gen_len, []
    print(f"{path}: {args.group_size} rollouts of {n_prompts} test problems at T {args.temperature}; "
          f"per token: log pi = the random-order log-likelihood, ELBO, gap; freq: share of "
          f"{args.sampler_draws} draws that write it")
    for i, (prompt, text) in enumerate(zip(batch.prompts, batch.texts)):
        r = {"prompt": prompt, "completion": text, "reward": batch.rewards[i].item(),
             **{name: exact[name][i].item() / L for name in exact},
             "sampler_frequency": freq[i].item(), "sampler_frequency_se": se[i].item()}
        rows.append(r)
        print(f"  {prompt} -> {text!r:14} reward {r['reward']:.1f} | log pi {r['log_likelihood']:+.3f} | "
              f"ELBO {r['elbo']:+.3f} | gap {r['gap']:.3f} | freq {freq[i]:.3f} +- {se[i]:.3f}")
    return rows

def track(runs, task, per_seed, out_dir, n_prompts=8):
    """Where whole runs moved the SFT model's own answers: per seed, G rollouts of the first n_prompts
    test problems from its SFT model, then their exact log-likelihood and ELBO per token under the SFT
    model and under each run's last checkpoint (runs: folder patterns with {seed}), in float32 (the changes
    are tenths of a nat). Prints each seed's mean change per token for the wrong and the right answers, then
    per run the mean over seeds with its interval, and each run minus the first, paired by seed; writes
    negatives_track.json in out_dir and returns its rows."""
    changes = {}   # (run, "wrong" or "right", measure) -> {seed: the mean change per token}
    for args in per_seed:
        sft = bgpo.load_model(rl.sft_path(args), task, args).cpu()
        batch = rl.tracked_answers(sft, task, args, n_prompts)
        x, y, right = batch.x.cpu(), batch.y.cpu(), (batch.rewards == 1.0).cpu()
        before = exact_measures(sft, x, y)
        line = f"seed {args.seed}: {int(right.sum())} right, {int((~right).sum())} wrong |"
        for run in runs:
            path = os.path.join(run.format(seed=args.seed), "ckpt.pt")
            after = exact_measures(bgpo.load_model(path, task, args).cpu(), x, y)
            for kind, rows in (("wrong", ~right), ("right", right)):
                for name in ("log_likelihood", "elbo"):
                    if rows.any():
                        change = (after[name] - before[name])[rows].mean().item() / task.gen_len
                        changes.setdefault((run, kind, name), {})[args.seed] = change
            wrong = changes[run, "wrong", "log_likelihood"][args.seed]
            right_change = changes.get((run, "right", "log_likelihood"), {}).get(args.seed, math.nan)
            line += f" {os.path.basename(run)}: wrong {wrong:+.3f} right {right_change:+.3f}"
        print(line + " (log pi per token)")
    rows = []
    print("\nchange per token (nats) of the SFT model's answers, from the SFT model to the run's last model, "
          "mean over seeds [95% interval]; minus the first run: paired by seed")
    for (run, kind, name), by_seed in changes.items():
        mean, half_width = interval(list(by_seed.values()))
        first = changes[runs[0], kind, name]
        paired = [by_seed[seed] - first[seed] for seed in by_seed if seed in first]
        d_mean, d_half = interval(paired) if run != runs[0] and paired else (math.nan, math.nan)
        rows.append({"run": run, "answers": kind, "measure": name, "mean": mean, "half_width": half_width,
                     "minus_first": d_mean, "minus_first_half_width": d_half, "per_seed": by_seed})
        print(f"  {os.path.basename(run):<40} {kind:<6} {name:<15} {mean:+.3f} [{mean - half_width:+.3f}, "
              f"{mean + half_width:+.3f}]" + (f" | minus the first {d_mean:+.3f} [{d_mean - d_half:+.3f}, "
                                             f"{d_mean + d_half:+.3f}]" if run != runs[0] else ""))
    cli.write_json(os.path.join(out_dir, "negatives_track.json"), {"runs": runs, "rows": rows})
    return rows

def track_logs(runs, seeds, out_dir):
    """What lab.rl --track-answers logged at every evaluation of whole runs (runs: folder patterns with
    {seed}): the exact log pi per token of the SFT model's wrong and right answers. Prints, per run, the
    change from step 0 to the last evaluation, mean over seeds [95% interval], and each run minus the first,
    paired by seed; draws the curves (mean over seeds, with the interval) as negatives_track.png in out_dir.
    Returns the figure's data."""
    panels = []
    print("exact log pi per token of the SFT model's answers (lab.rl --track-answers): change from step 0 to "
          "the last evaluation, mean over seeds [95% interval]; minus the first run: paired by seed")
    for kind in ("wrong", "right"):
        lines, first = [], None
        for n, run in enumerate(runs):
            by_step = {}   # step -> {seed: value}
            for seed in seeds:
                for r in read_log(os.path.join(run.format(seed=seed), "log.jsonl")):
                    if r.get(f"track_{kind}_log_pi") is not None:
                        by_step.setdefault(r["step"], {})[seed] = r[f"track_{kind}_log_pi"]
            if not by_step:   # no answer of this kind among the tracked ones
                continue
            if 0 not in by_step:
                raise bgpo.RunError(f"--track-logs: {run} logged no tracked answers at step 0 (give "
                                    "--track-answers from the run's start)")
            label = os.path.basename(run).split("_seed")[0]
            lines.append({"label": label, **band(by_step)})
            last = max(by_step)
            change = {s: by_step[last][s] - by_step[0][s] for s in by_step[last] if s in by_step[0]}
            mean, half = interval(list(change.values()))
            text = (f"  {kind:<6} {label:<24} step {last}, {len(change)} seeds: {mean:+.3f} "
                    f"[{mean - half:+.3f}, {mean + half:+.3f}]")
            if n == 0:
                first = change
            elif first is not None:   # the first run has answers of this kind
                d, d_half = interval([change[s] - first[s] for s in change if s in first])
                text += f" | minus the first {d:+.3f} [{d - d_half:+.3f}, {d + d_half:+.3f}]"
            print(text)
        panels.append({"title": f"exact log pi per token, the SFT model's {kind} answers",
                       "xlabel": "RL step", "lines": lines})
    figure = {"panels": panels}
    draw(figure, os.path.join(out_dir, "negatives_track.png"))
    return figure

def main(argv=None):
    p = cli.make_parser("python -m lab.negatives", __doc__.strip().split("\n")[0])
    a = p.add_argument
    a("--seeds", type=parse_seeds, default=parse_seeds("0-2"), help="seeds, e.g. 0-2 or 0,3")
    a("--batches", type=int, default=2, help="rollout batches per seed, drawn from its SFT model")
    a("--groups", type=int, default=2,
      help="groups with a signal measured per batch (each row: 5 enumerations of its 2^L - 1 masks)")
    a("--sampler-draws", type=int, default=500, help="fresh samples per prompt for the sampler's frequency")
    a("--small-step", type=float, default=1e-3,
      help="the small step's norm in parameter space (AdamW's first step at --rl-lr 1e-4: about 0.08)")
    a("--advantages", choices=list(ADVANTAGES), default="group", help="as lab.rl's")
    a("--objective", choices=["bgpo", "spg"], default="bgpo",
      help=f"the update measured: BGPO's, or SPG's (beta {SPG_BETA}, mix {SPG_MIX})")
    a("--describe", default=None, metavar="CHECKPOINT",
      help="instead: the measures of the completions this checkpoint's model writes (2 test problems)")
    a("--track", default=None, metavar="RUN,RUN",
      help="instead: the SFT model's answers under these runs' last models; folders with {seed}")
    a("--track-logs", default=None, metavar="RUN,RUN",
      help="instead: what these runs' lab.rl --track-answers logged at every evaluation, and its figure")
    args = p.parse_args(argv)
    args.spg_beta, args.spg_mix = SPG_BETA, SPG_MIX
    for flag in ("batches", "groups", "sampler_draws"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.small_step) and args.small_step > 0):
        p.error(f"--small-step must be positive, got {args.small_step}")
    task, units, t0 = get_task(args.task), [], time.time()
    if args.describe:
        if not os.path.isfile(args.describe):
            raise bgpo.RunError(f"--describe: no checkpoint at {args.describe}")
        return describe(args.describe, task, cli.check_args(p, args))
    if args.track_logs:
        runs = args.track_logs.split(",")
        for run, seed in itertools.product(runs, args.seeds):
            if not os.path.isfile(os.path.join(run.format(seed=seed), "log.jsonl")):
                raise bgpo.RunError(f"--track-logs: no log.jsonl in {run.format(seed=seed)}")
        return track_logs(runs, args.seeds, args.out_dir)
    per_seed = [cli.check_args(p, argparse.Namespace(**{**vars(args), "seed": seed})) for seed in args.seeds]
    for seeded in per_seed:   # every SFT model is there before any is measured
        if not os.path.isfile(rl.sft_path(seeded)):
            raise bgpo.RunError(f"no SFT model at {rl.sft_path(seeded)} (python -m lab.rl --stage sft "
                                f"--seed {seeded.seed})")
    if args.track:
        runs = args.track.split(",")
        for run, seeded in itertools.product(runs, per_seed):
            if not os.path.isfile(os.path.join(run.format(seed=seeded.seed), "ckpt.pt")):
                raise bgpo.RunError(f"--track: no checkpoint in {run.format(seed=seeded.seed)}")
        return track(runs, task, per_seed, args.out_dir)
    for seeded in per_seed:
        seed, model = seeded.seed, bgpo.load_model(rl.sft_path(seeded), task, seeded)
        generator = torch.Generator().manual_seed(seed + 1)   # lab.rl's: batch 1 is its first rollout batch
        for b in range(args.batches):
            unit = one_unit(model, task, seeded, generator)
            if unit is None:
                print(f"seed {seed} batch {b + 1}: no group with a signal (every group's rewards tie)")
                continue
            units.append(unit)
            signs = unit["sign"]
            print(f"seed {seed} batch {b + 1}: {unit['groups']} groups, {unit['rows']} completions "
                  f"({int((signs < 0).sum())} negative, {int((signs > 0).sum())} positive) | "
                  f"{time.time() - t0:.0f} s")
    if not units:
        raise bgpo.RunError("no rollout batch had a group with a signal: nothing to measure")
    table = summarise(units, task.gen_len)
    before = [u["before"] for u in units]
    margin = torch.cat([b["spg_bound"] - b["log_likelihood"] for b in before]) / task.gen_len
    print(f"\nbefore the update, SPG's bound (beta {SPG_BETA}, exact, in expectation over its copies) is "
          f"below log pi for {int((margin < 0).sum())} of {len(margin)} completions; margin per token: "
          f"min {margin.min().item():+.3f}, median {margin.median().item():+.3f}, "
          f"max {margin.max().item():+.3f}")
    print(f"\nchange per token (nats) of the completions' likelihood after one step on one half of the "
          f"update: per seed the mean over its batches, then the mean over {len(args.seeds)} seeds [95% "
          f"interval]; the shares of the rows, pooled, whose value fell and rose\nsampler: change of the "
          f"frequency with which the sampler writes the completion, from {args.sampler_draws} draws of its "
          f"prompt\n")
    print(f"{'update':<10}{'step':<9}{'rows':<10}{'measure':<18}{'mean change':>24}{'fell':>6}{'rose':>6}")
    for r in table:
        value = f"{r['mean']:+.2e} [{r['mean'] - r['half_width']:+.1e}, {r['mean'] + r['half_width']:+.1e}]"
        print(f"{r['update']:<10}{r['step']:<9}{r['rows']:<10}{r['measure']:<18}{value:>24}"
              f"{r['share_fell']:>6.2f}{r['share_rose']:>6.2f}")
    name = "negatives.json" if args.objective == "bgpo" else f"negatives_{args.objective}.json"
    cli.write_json(os.path.join(args.out_dir, name),
                   {"seeds": args.seeds, "batches": args.batches, "groups": args.groups,
                    "sampler_draws": args.sampler_draws, "rl_lr": args.rl_lr, "small_step": args.small_step,
                    "objective": args.objective, "spg_margin_per_token": margin.tolist(), "table": table})
    return table

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.negatives")
