"""
The entropy-performance law of Cui et al. ("The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617), fitted to this model's RL runs:

    R = -a exp(H) + b

R is a run's greedy progress accuracy and H the entropy of its policy's predictions (nats per masked position:
lab.rl's eval_entropy), both at each evaluation of the run. Linear in exp(H), so the fit is least squares in
closed form. Its ceiling, the accuracy the law predicts once the entropy is spent (H = 0), is b - a.

    python -m lab.entropy_law out/RUN [out/RUN ...] [--fit-steps 200] [--png out/entropy_law.png]

Per run: a, b and the fit's RMSE over all its evaluations; the ceiling fitted from the evaluations at steps up
to --fit-steps alone (a prediction), against the accuracy the run reached at its last evaluation. Over the
runs: one law pooled from every evaluation (the paper reports a and b shared across algorithms for one model
and its data), and one per group of runs that differ only by seed (their run.json flags: a sweep's arms). The
figure: accuracy against entropy, a curve per run in its group's colour, and each group's pooled law.
"""
import argparse
import json
import math
import os
import sys

from lab import cli
from lab.figures import draw

def fit_law(entropies, accuracies):
    """Least squares of R = b - a exp(H) over the points: (a, b, RMSE). Needs two distinct entropies."""
    if len(entropies) != len(accuracies):
        raise ValueError(f"entropies and accuracies: {len(entropies)} and {len(accuracies)} points")
    x = [math.exp(h) for h in entropies]
    n, mean_x, mean_r = len(x), sum(x) / len(x) if x else 0.0, sum(accuracies) / max(len(x), 1)
    sxx = sum((xi - mean_x) ** 2 for xi in x)
    if n < 2 or sxx == 0:
        raise ValueError("entropies: the law needs two or more points with different entropies")
    slope = sum((xi - mean_x) * (ri - mean_r) for xi, ri in zip(x, accuracies)) / sxx
    a, b = -slope, mean_r - slope * mean_x
    rmse = math.sqrt(sum((b - a * xi - ri) ** 2 for xi, ri in zip(x, accuracies)) / n)
    return a, b, rmse

def read_points(run_dir):
    """A run's evaluations: [(step, entropy, accuracy)] from its log.jsonl, in step order."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no log.jsonl")
    records = [json.loads(line) for line in open(path)]
    points = sorted((r["step"], r["eval_entropy"], r["accuracy"]) for r in records
                    if "accuracy" in r and "eval_entropy" in r)
    if len(points) < 2:
        raise ValueError(f"{run_dir}: fewer than 2 evaluations with an entropy (lab.rl logs eval_entropy)")
    return points

IGNORED = ("seed", "run_name", "out_dir", "device", "resume", "overwrite", "stage")   # not what a run is

def group_of(run_dirs):
    """{run_dir: its group's label}: the run.json flags on which the runs differ, but the seed and where the
    run was written ("" for runs without a run.json, and where all runs share their flags)."""
    flags = {}
    for run in run_dirs:
        path = os.path.join(run, "run.json")
        flags[run] = json.load(open(path)).get("flags", {}) if os.path.isfile(path) else {}
    keys = sorted({k for f in flags.values() for k in f if k not in IGNORED})
    differ = [k for k in keys if len({json.dumps(f.get(k)) for f in flags.values()}) > 1]
    return {run: " ".join(f"--{k.replace('_', '-')} {flags[run].get(k)}" for k in differ) for run in run_dirs}

def law_figure(runs, groups, laws):
    """Accuracy against entropy: {name: points} as curves, coloured by groups[name], and each group's law
    (a, b) from laws over its runs' entropies."""
    colour, lines, seen = {group: f"C{i}" for i, group in enumerate(laws)}, [], set()
    for name, points in runs.items():   # one legend entry per group
        group = groups[name]
        lines.append({"label": "_nolegend_" if group in seen else group or "runs", "style": "o-",
                      "alpha": 0.6, "color": colour[group],
                      "x": [h for _, h, _ in points], "y": [r for _, _, r in points]})
        seen.add(group)
    for group, (a, b) in laws.items():
        entropies = [h for name, points in runs.items() if groups[name] == group for _, h, _ in points]
        low, high = min(entropies), max(entropies)
        grid = [low + (high - low) * i / 50 for i in range(51)]
        lines.append({"label": f"R = {-a:.3f} exp(H) + {b:.3f}", "x": grid, "y": [b - a * math.exp(h)
                      for h in grid], "style": "--", "color": colour[group]})
    return {"panels": [{"title": "progress accuracy against the policy's entropy, every evaluation of a run",
                        "xlabel": "entropy (nats per masked position)", "lines": lines}], "width": 7.0}

def main(argv=None):
    p = cli.ArgumentParser(prog="python -m lab.entropy_law", description=__doc__.strip().split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", help="RL run folders (lab.rl's), each with its log.jsonl")
    p.add_argument("--fit-steps", type=int, default=200,
                   help="the prediction's fit uses the evaluations at steps up to this")
    p.add_argument("--png", default=None, help="the figure's path (None: no figure); needs matplotlib")
    args = p.parse_args(argv)
    if args.fit_steps < 1:
        p.error(f"--fit-steps must be at least 1, got {args.fit_steps}")
    try:
        runs = {os.path.basename(os.path.normpath(run)): read_points(run) for run in args.runs}
    except ValueError as e:
        p.error(str(e))
    groups = {os.path.basename(os.path.normpath(run)): g for run, g in group_of(args.runs).items()}
    print(f"R = -a exp(H) + b per run: a, b, RMSE over every evaluation; the ceiling b - a from the "
          f"evaluations at steps <= {args.fit_steps} alone, against the run's last accuracy (points)")
    rows = {}
    for name, points in runs.items():
        try:
            a, b, rmse = fit_law([h for _, h, _ in points], [r for _, _, r in points])
        except ValueError as e:
            p.error(f"{name}: {e}")
        early = [pt for pt in points if pt[0] <= args.fit_steps]
        try:
            a_early, b_early, _ = fit_law([h for _, h, _ in early], [r for _, _, r in early])
            predicted = b_early - a_early
        except ValueError:   # fewer than two early evaluations
            predicted = math.nan
        last = points[-1]
        rows[name] = {"a": a, "b": b, "rmse": rmse, "ceiling": b - a, "predicted": predicted,
                      "last_step": last[0], "last_accuracy": last[2], "last_entropy": last[1]}
        print(f"  {name:<44} a {a:7.3f}  b {b:7.3f}  RMSE {rmse:.3f}  ceiling {b - a:6.3f}  predicted "
              f"{predicted:6.3f}  step {last[0]}: {last[2]:.3f} (H {last[1]:.3f}, {len(points)})")
    order = list(dict.fromkeys(groups.values()))
    sets = [(group, [name for name in runs if groups[name] == group]) for group in order]
    sets += [(None, list(runs))] if len(order) > 1 else []   # and every run together
    pooled = {}
    for group, names in sets:
        points = [pt for name in names for pt in runs[name]]
        a, b, rmse = fit_law([h for _, h, _ in points], [r for _, _, r in points])
        pooled[group] = {"a": a, "b": b, "rmse": rmse, "ceiling": b - a}
        print(f"pooled over {len(names)} runs ({len(points)} points){' ' + group if group else ''}: a {a:.3f}"
              f"  b {b:.3f}  RMSE {rmse:.3f}  ceiling {b - a:.3f}")
    if args.png:
        draw(law_figure(runs, groups, {group: (pooled[group]["a"], pooled[group]["b"]) for group in order}),
             args.png)
    return {"runs": rows, "groups": {group: pooled[group] for group in order},
            "pooled": pooled[None if len(order) > 1 else order[0]]}

if __name__ == "__main__":
    main(sys.argv[1:])
