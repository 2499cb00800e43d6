"""
The activation memory and time of one update of every RL objective, on the same batch: which grow
with their sample count. bgpo.py --bench-memory has BGPO against the naive objective (the paper's
Fig. 1); this adds the exact naive gradient in two passes (naive_two_pass_backward) beside them, on-
and off-policy, then the field's objectives of lab/objectives.py; with --plot, bgpo.py's table, drawn.

    python -m lab.bench_memory [--task T] [--plot] [--device cuda] [any bgpo.py flag] [--bench-repeats N]
"""
import argparse
import math
import os

import torch

import bgpo
from bgpo import group_advantages, make_model
from lab import cli
from lab.figures import draw
from lab.objectives import OBJECTIVES, SPG_BETA, SPG_MIX
from lab.sampler import Rollouts
from tasks import encode, get_task
from tiny_dllm import measure_update

def bench_batch(task, args):
    """bgpo.bench_memory's batch (a copy): B = G x prompts demonstrations with random rewards, which never
    tie, so that every row is in the update (memory and time depend on the shapes, not the values); and, for
    the objectives that read a sampler's trajectory, a random writing order as commit_steps.
    Returns the batch as Rollouts, its A and the generator."""
    B, generator = args.group_size * args.prompts_per_step, torch.Generator().manual_seed(args.seed)
    prompts, answers = task.sample(B, "train", generator)
    x, y = encode(task, prompts, answers, device=args.device)
    rewards = torch.rand(B, generator=generator)
    commit = torch.rand(B, task.gen_len, generator=generator).argsort(1).argsort(1).to(args.device)
    A = group_advantages(rewards, args.group_size).to(args.device)
    return Rollouts(prompts, x, y, commit, answers, rewards), A, generator

def measured(model, optimizer, backward, args):
    """backward() then an optimizer step, measured as bgpo.bench_memory measures an update (measure_update),
    --bench-repeats times: (peak activation MiB, median seconds, CUDA MiB or nan); nan everywhere if it
    ran out of memory."""
    m = measure_update(model, lambda: (backward(), optimizer.step()), args.bench_repeats)
    if m is None:
        return math.nan, math.nan, math.nan
    return m["mb"], m["s"], math.nan if m["cuda_mb"] is None else m["cuda_mb"]

def memory_figure(rows):
    """The paper's Fig. 1 in small: bgpo.bench_memory's rows ({"n_t", "naive", "bgpo"}, each objective's
    {"mb", "s", ...} or None where it ran out of memory) -> the activation memory of one update and the
    step-time ratio against n_t, over the rows where both ran."""
    rows = [r for r in rows if r["naive"] and r["bgpo"]]
    n = [r["n_t"] for r in rows]
    memory = [{"label": label, "x": n, "y": [r[name]["mb"] for r in rows], "style": "o-"}
              for name, label in (("naive", "naive"), ("bgpo", "BGPO"))]
    ratio = [{"label": "BGPO / naive", "x": n, "y": [r["bgpo"]["s"] / r["naive"]["s"] for r in rows],
              "style": "o-"}]
    return {"panels": [{"title": "activation memory of one update (MiB)", "xlabel": "n_t", "xscale": "log",
                        "yscale": "log", "lines": memory},
                       {"title": "step time, BGPO / naive", "xlabel": "n_t", "xscale": "log",
                        "lines": ratio}]}

def two_pass_table(args, task):
    """The naive gradient in two passes against BGPO and the one-graph naive objective, at n_t 1 to 64.
    On-policy the two-pass update skips its first pass; off-policy (the update of a second mini-batch,
    with the rollout policy's terms computed beforehand, as bgpo.run_rl does) it runs it."""
    torch.manual_seed(args.seed)
    model = make_model(task, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    (batch, A, generator), rows = bench_batch(task, args), []
    names = {"naive": "naive", "bgpo": "BGPO", "naive-two-pass": "two-pass"}
    for policy, minibatches in (("on-policy", 1), ("off-policy", 2)):
        print(f"\n{policy}: one update on B = {len(A)} sequences (activation MiB | median seconds)")
        print(f"{'n_t':>4} | " + " ".join(f"{name + ' MiB':>11}" for name in names.values()) + " | "
              + " ".join(f"{name + ' s':>10}" for name in names.values()) + f" | {'two-pass/BGPO s':>15}")
        for n_t in (1, 2, 4, 8, 16, 32, 64):
            settings = argparse.Namespace(**{**vars(args), "updates_per_batch": 1, "minibatches": minibatches,
                                             "mc_samples": n_t, "mc_chunk": 1})
            state = OBJECTIVES["bgpo"].prepare(model, batch, settings, generator)  # the draws of all three
            row = {"policy": policy, "n_t": n_t}
            for objective in names:
                backward = lambda: OBJECTIVES[objective].backward(model, batch, state, A, settings, 0)
                row[f"{objective}_mb"], row[f"{objective}_s"], _ = measured(model, optimizer, backward, args)
            rows.append(row)
            print(f"{n_t:>4} | " + " ".join(f"{row[o + '_mb']:>11.1f}" for o in names) + " | "
                  + " ".join(f"{row[o + '_s']:>10.3f}" for o in names)
                  + f" | {row['naive-two-pass_s'] / row['bgpo_s']:>15.2f}")
    return rows

def every_objective_table(args, task):
    """One update of every objective on bench_batch's batch, at its sample counts."""
    torch.manual_seed(args.seed)
    model = make_model(task, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    (batch, A, generator), cuda = bench_batch(task, args), args.device.startswith("cuda")

    def measure(objective, n):
        settings = argparse.Namespace(**{**vars(args), "updates_per_batch": 1, "block_len": None,
                                         "mc_samples": n})
        state = OBJECTIVES[objective].prepare(model, batch, settings, generator)
        backward = lambda: OBJECTIVES[objective].backward(model, batch, state, A, settings, 0)
        return measured(model, optimizer, backward, args)

    print("\nEvery objective, one update on the same batch: which grow with their sample count")
    print(f"{'objective':>14} | {'samples':>22} | {'act MiB':>8} | {'s':>7}"
          + (f" | {'CUDA MiB':>8}" if cuda else ""))
    rows = []
    for objective, what, counts in (("bgpo", "n_t masked copies", (1, 16)),
                                    ("naive", "n_t masked copies", (1, 16)),
                                    ("naive-two-pass", "n_t masked copies", (1, 16)),
                                    ("stp", "num_t masked copies", (1, 3, 16)),
                                    ("spg", "n_t masked copies", (1, 16)),
                                    ("diffu-grpo", "1 prompt mask", (1,)),
                                    ("dtrpo", "1 step per block", (1,)),
                                    ("trajectory", f"all {task.gen_len} steps", (1,))):
        for n in counts:
            mb, s, cuda_mb = measure(objective, n)
            label = what if len(counts) == 1 else f"{n} {what}"
            rows.append({"objective": objective, "samples": n, "act_mb": mb, "s": s})
            print(f"{objective:>14} | {label:>22} | {mb:>8.1f} | {s:>7.3f}"
                  + (f" | {cuda_mb:>8.1f}" if cuda else ""))
    return rows

def parse_args(argv=None):
    p = cli.make_parser("python -m lab.bench_memory",
                        "Activation memory and time of one update of every objective.")
    p.add_argument("--plot", action="store_true", help="run bgpo.py's naive-vs-BGPO table instead, and draw "
                   "it (the paper's Fig. 1) as memory_TASK_DEVICE.png in --out-dir (needs matplotlib)")
    args = cli.check_args(p, p.parse_args(argv))
    # the lab objectives' options off
    args.anchors, args.remasking, args.stp_tau = False, "low_confidence", None
    args.spg_beta, args.spg_mix = SPG_BETA, SPG_MIX
    return args

def main(argv=None):
    args = parse_args(argv)
    task = get_task(args.task)
    if args.plot:
        rows = bgpo.bench_memory(args, task)
        os.makedirs(args.out_dir, exist_ok=True)
        return draw(memory_figure(rows), os.path.join(args.out_dir, f"memory_{task.name}_{args.device}.png"))
    two_pass_table(args, task)
    return every_objective_table(args, task)

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.bench_memory")
