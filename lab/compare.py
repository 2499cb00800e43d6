"""
Several RL runs' curves in one figure: the rollout reward and the progress accuracy against the RL
step (the paper's Fig. 2 in small). A LABEL=RUN,RUN,... argument draws the mean of those runs (seeds)
as one line.

    python -m lab.compare RUN ... [LABEL=RUN,RUN ...] [--out-dir out] [--png compare.png]
"""
import argparse
import os
import statistics

from lab.cli import ArgumentParser
from lab.figures import curves_figure, draw, read_log

def mean_of_runs(logs):
    """Several runs' records (seeds) -> one: at each step, the mean reward and accuracy of the runs
    that have it."""
    if len(logs) == 1:
        return logs[0]
    steps = sorted({r["step"] for records in logs for r in records})
    at = [{r["step"]: r for r in records} for records in logs]
    return [{"step": s, **{k: statistics.mean(run[s][k] for run in at) for k in ("reward", "accuracy")
                           if all(k in run.get(s, {}) for run in at)}} for s in steps]

def main(argv=None):
    p = ArgumentParser(prog="python -m lab.compare", description=__doc__.strip().split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="RL run folders in --out-dir, or LABEL=RUN,RUN,... for their mean")
    p.add_argument("--out-dir", default="out",
                   help="where the runs are, and where the figure goes (default: %(default)s)")
    p.add_argument("--png", default="compare.png",
                   help="the figure's file name in --out-dir (default: %(default)s)")
    args = p.parse_args(argv)
    runs = dict(s.split("=", 1) if "=" in s else (s, s) for s in args.runs)   # {label: "RUN,RUN,..."}
    missing = [r for group in runs.values() for r in group.split(",")
               if not os.path.isfile(os.path.join(args.out_dir, r, "log.jsonl"))]
    if missing:
        p.error(f"no log.jsonl in {os.path.join(args.out_dir, missing[0])}")
    logs = {label: mean_of_runs([read_log(os.path.join(args.out_dir, r, "log.jsonl"))
                                 for r in group.split(",")])
            for label, group in runs.items()}
    return draw(curves_figure(logs), os.path.join(args.out_dir, args.png))

if __name__ == "__main__":
    main()
