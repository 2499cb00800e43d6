"""
The entropy-performance law of Cui et al. ("The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617), fitted to this model's RL runs:

    R = -a exp(H) + b

R is a run's greedy held-out accuracy and H the entropy of its policy's predictions (nats per masked position:
lab.rl's eval_entropy), both at each evaluation of the run. Linear in exp(H), so the fit is least squares in
closed form. Its ceiling, the accuracy the law predicts once the entropy is spent (H = 0), is b - a.

    python -m lab.entropy_law out/RUN [out/RUN ...] [--fit-steps 200] [--png out/entropy_law.png]

Per run: a, b and the fit's RMSE over all its evaluations; the ceiling fitted from the evaluations at steps up
to --fit-steps alone (a prediction), against the accuracy the run reached at its last evaluation. Over the
runs: one law pooled from every evaluation (the paper reports a and b shared across algorithms for one model
and its data). The figure: accuracy against entropy, a curve per run, and the pooled law.
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

def law_figure(runs, pooled):
    """Accuracy against entropy: {name: points} as curves, and the pooled law (a, b) over their entropies."""
    lines = [{"label": name, "x": [h for _, h, _ in points], "y": [r for _, _, r in points], "style": "o-",
              "alpha": 0.7} for name, points in runs.items()]
    entropies = [h for points in runs.values() for _, h, _ in points]
    low, high = min(entropies), max(entropies)
    grid = [low + (high - low) * i / 50 for i in range(51)]
    a, b = pooled
    lines.append({"label": f"R = -{a:.3f} exp(H) + {b:.3f}", "x": grid,
                  "y": [b - a * math.exp(h) for h in grid],
                  "style": "--", "color": "black"})
    return {"panels": [{"title": "held-out accuracy against the policy's entropy (a run moves right to left)",
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
    everything = [pt for points in runs.values() for pt in points]
    a, b, rmse = fit_law([h for _, h, _ in everything], [r for _, _, r in everything])
    print(f"pooled over {len(runs)} runs ({len(everything)} points): a {a:.3f}  b {b:.3f}  RMSE {rmse:.3f}  "
          f"ceiling {b - a:.3f}")
    if args.png:
        draw(law_figure(runs, (a, b)), args.png)
    return {"runs": rows, "pooled": {"a": a, "b": b, "rmse": rmse, "ceiling": b - a}}

if __name__ == "__main__":
    main(sys.argv[1:])
