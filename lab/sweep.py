"""
An experiment: arms x seeds, paired by seed. Each seed's SFT model is trained once (bgpo.py --stage sft) and
every arm starts from it, so the arms of a seed share their SFT model, their test problems and their
first rollout prompts; the difference between two arms on one seed is then free of the SFT lottery.

    python -m lab.sweep --seeds 0-4 --arms bgpo,rft,sft-continued,nt1,neg-weight-1 [--workers 2] [flags]

Every arm is a named set of flags of python -m lab.rl (the lab's copy of bgpo.run_rl, with its diagnostics)
or of python -m lab.control; the sweep prints each run's command, so one arm can be run alone. The runs go
as worker processes (--workers at a time, --threads each), each to its own folder in --out-dir, with its
console output in console.txt there. A finished run (its final.json, on --final-eval-size problems) is read,
not run again; an interrupted RL run continues from its last checkpoint, and a control, or an RL run stopped
before its first checkpoint, starts again: running the same command again finishes an interrupted sweep.

The table: per arm, the mean over seeds of the final test accuracy on --final-eval-size problems, with
its 95% interval (Student t over seeds), and the paired difference (same seed) from the SFT model and from
--reference, with their intervals. An interval that includes 0 means "not distinguishable here". With
--at-step, the same table from the progress evaluations at an RL step, one for all arms (600) or one per arm
(bgpo=1200,dyn=550: at equal seconds, when the steps are in the ratio of the arms' costs). Where a run's
folder holds lab.reach's reach.json (--reference, --json RUN/reach.json), the table of new solves. Then what
the RL runs logged (lab.rl's diagnostics). The figure: progress accuracy (the runs' progress evaluations,
--eval-size problems) against the RL step, a line per arm with its 95% interval as a band, as it is and
minus the seed's SFT model. With three or more arms that differ by --mc-samples alone (bgpo, nt1, nt2, ...),
also a table and a figure (_nt.png) against n_t: the final accuracy, and the update's seconds a step.
"""
import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

import bgpo
from lab import cli, control, rl
from lab.figures import draw, read_log

ARMS = {   # name: (module, flags); every RL arm runs lab.rl's loop, so that arms differ by their flags only
    "bgpo": ("lab.rl", []),                                     # the default: BGPO, n_t 8, negatives x 0.5
    "rft": ("lab.rl", ["--advantages", "rft"]),                 # rejection sampling: learn the solved answers
    "sft-continued": ("lab.control", []),                       # SFT on the demonstrations, bgpo's seconds
    "nt1": ("lab.rl", ["--mc-samples", "1"]),                   # one masked copy per completion
    **{f"nt{n}": ("lab.rl", ["--mc-samples", str(n)]) for n in (2, 4, 16, 32)},   # the n_t curve
    # the same model FLOPs a step as the default (bench_step's count: rows x (L + 3 n_t) token passes, within
    # 4%), spent on masked copies or on rollouts: n_t 16 with 9 prompts, n_t 4 with 25, n_t 2 with 34
    **{f"nt{n}-p{p}": ("lab.rl", ["--mc-samples", str(n), "--prompts-per-step", str(p)])
       for n, p in ((16, 9), (4, 25), (2, 34))},
    "neg-weight-1": ("lab.rl", ["--neg-weight", "1"]),          # the paper's weight of negative advantages
    "no-std": ("lab.rl", ["--advantages", "no-std"]),           # A = r - mean, without Eq. 18's / std
    "solved-reward": ("lab.rl", ["--reward", "solved"]),        # no 0.1 for a well-formed wrong answer
    "g16": ("lab.rl", ["--group-size", "16", "--prompts-per-step", "8"]),  # the same 128 rollouts in 8 groups
    "g32": ("lab.rl", ["--group-size", "32", "--prompts-per-step", "4"]),  # ... and in 4 groups
    "w-reinforce": ("lab.rl", ["--advantages", "w-reinforce", "--neg-weight", "1"]),  # +0.1 solved, -1 not
    "spg": ("lab.rl", ["--objective", "spg"]),                  # SPG: an upper bound of log pi where A < 0
    "cov-detach": ("lab.rl", ["--cov-detach", "0.02"]),         # BGPO, top 2% covariance positions detached
    "cov-detach-20": ("lab.rl", ["--cov-detach", "0.2"]),       # ... the top 20%
    "cov-detach-low-20": ("lab.rl", ["--cov-detach", "-0.2"]),  # ... the bottom 20%, the lowest covariance
    "entropy-bonus": ("lab.rl", ["--entropy-coef", "0.01"]),    # BGPO with an entropy bonus
    # RL past the SFT model's reach (lab/levers.py): DAPO's dynamic sampling, at most 3 sampler batches a
    # step; rollouts from the random-order model the ELBO bounds; IGPO's inpainted hints, and their control
    "dyn": ("lab.rl", ["--dynamic-batches", "3"]),
    "rand-order": ("lab.rl", ["--remasking", "random", "--temperature", "1.0"]),
    "hint": ("lab.rl", ["--hints", "inpaint"]),
    "lr2e-4": ("lab.rl", ["--rl-lr", "2e-4"]),                   # twice the RL learning rate
    "lr3e-4": ("lab.rl", ["--rl-lr", "3e-4"]),                   # three times
    "sft-hints": ("lab.rl", ["--hints", "solution"]),
    # the levers combined: hints inside dynamic sampling, where a hinted group counts as kept; and hints whose
    # share of the solution falls over the run, so that the last steps' rollouts are the policy's own
    "dyn-hint": ("lab.rl", ["--dynamic-batches", "3", "--hints", "inpaint"]),
    "hint-decay": ("lab.rl", ["--hints", "inpaint", "--hint-decay"]),
    # from reach to answers, per second: selective rollouts (2 probe rollouts of twice the prompts; those
    # whose probes differ kept first); rollouts written left to right (JustGRPO), evaluations unchanged; and
    # widen, then sharpen: dynamic sampling with hints whose share falls over the run
    "sel": ("lab.rl", ["--probe", "2"]),
    "ltr": ("lab.rl", ["--rollout-order", "left-to-right"]),
    "dyn-hint-decay": ("lab.rl", ["--dynamic-batches", "3", "--hints", "inpaint", "--hint-decay"]),
}

# -----------------------------------------------------------------------------
# Intervals

@functools.lru_cache
def t_quantile(p, df):
    """Student t's p-quantile (0.5 < p < 1) with df degrees of freedom: bisection on its CDF, integrated by
    Simpson's rule from the density (no scipy)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    density = lambda t: c * (1 + t * t / df) ** (-(df + 1) / 2)

    def cdf(x, n=2000):
        h = x / n
        return 0.5 + h / 3 * (density(0) + density(x) + sum((4 if i % 2 else 2) * density(i * h)
                                                             for i in range(1, n)))
    lo, hi = 0.0, 100.0   # t_0.995 with df 1 is 63.7
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2

def interval(values):
    """(mean, half-width of its 95% interval): mean +- t_{0.975, n-1} s / sqrt(n); half-width nan if n < 2."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return mean, float("nan")
    return mean, t_quantile(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)

def show(mean, half, signed=False, percent=True):
    """A proportion and its interval in percent: "17.6 [15.1, 20.1]", or signed: "+5.2 [+1.0, +9.4]"; with
    percent=False, the value itself to 3 decimals."""
    scale, digits = (100, 1) if percent else (1, 3)
    f = (lambda v: f"{scale * v:+.{digits}f}") if signed else (lambda v: f"{scale * v:.{digits}f}")
    return f(mean) + (f" [{f(mean - half)}, {f(mean + half)}]" if not math.isnan(half) else "")

# -----------------------------------------------------------------------------
# The runs

def arm_argv(arm, seed, flags, final_eval_size, pass_at_k_size=0):
    module, arm_flags = ARMS[arm]
    return [*flags, *arm_flags, "--seed", str(seed), "--final-eval-size", str(final_eval_size),
            "--pass-at-k-size", str(pass_at_k_size), "--stage", "rl"]

def run_folder(arm, seed, flags, final_eval_size):
    """The folder an arm's run of a seed writes, as its own command names it."""
    argv = arm_argv(arm, seed, flags, final_eval_size)
    if ARMS[arm][0] == "lab.control":
        p = cli.make_parser("python -m lab.control", "")
        p.add_argument("--final-eval-size", type=int, default=0)
        p.add_argument("--pass-at-k-size", type=int, default=0)
        return control.control_dir(cli.check_args(p, p.parse_args(argv)))
    args = rl.parse_args(argv)
    return os.path.join(args.out_dir, args.run_name)

def sft_finished(args):
    """Whether the SFT checkpoint of these flags is a finished SFT's (it stopped early, or ran every step):
    an interrupted SFT leaves its best model so far under the same name."""
    if not os.path.isfile(rl.sft_path(args)):
        return False
    state = torch.load(rl.sft_path(args), map_location="cpu", weights_only=True)
    last = state["curve"][-1]["step"]
    if args.sft_stop:   # lab.rl --sft-stop N: the model of step N
        return state["step"] == args.sft_stop
    return last == args.sft_steps or (last - state["step"] >= bgpo.SFT_PATIENCE * args.sft_eval_every
                                      and last >= bgpo.SFT_MIN_STEPS[args.task])

def scored(final, args):
    """Whether a run's final.json is scored as this sweep asks: on as many problems, pass@k on as many."""
    return final["size"] == args.final_eval_size and final.get("pass_at_k_size", 0) == args.pass_at_k_size

def plan(args, flags):
    """The jobs: each seed's SFT, then its arms (sft-continued after the seed's bgpo run): dicts with name,
    argv, folder, after (the jobs it waits for) and done (its final.json scored on --final-eval-size)."""
    jobs = []
    for seed in args.seeds:
        sft_argv = [*flags, "--seed", str(seed), "--stage", "sft"]
        sft = {"name": f"sft seed {seed}", "argv": ["-m", "lab.rl", *sft_argv], "folder": None, "after": [],
               "log": rl.sft_path(rl.parse_args(sft_argv)) + ".console.txt",
               "done": sft_finished(rl.parse_args(sft_argv))}
        jobs.append(sft)
        for arm in args.arms:
            folder = run_folder(arm, seed, flags, args.final_eval_size)
            final = os.path.join(folder, "final.json")
            done = os.path.isfile(final) and scored(json.load(open(final)), args)
            module = ARMS[arm][0]
            argv = ["-m", module, *arm_argv(arm, seed, flags, args.final_eval_size, args.pass_at_k_size)]
            if module == "lab.rl" and os.path.isfile(os.path.join(folder, "ckpt.pt")):
                argv.append("--resume")   # interrupted, or scored on other problems: from its last checkpoint
            elif os.path.exists(os.path.join(folder, "log.jsonl")):
                argv.append("--overwrite")             # stopped before its first checkpoint, or a control
            jobs.append({"name": f"{arm} seed {seed}", "arm": arm, "seed": seed, "argv": argv, "after": [sft],
                         "folder": folder, "log": os.path.join(folder, "console.txt"), "done": done})
    for job in jobs:   # the control trains for as long as its seed's bgpo run did: after it, in any order
        if job.get("arm") and ARMS[job["arm"]][0] == "lab.control":
            job["after"] += [j for j in jobs if j.get("arm") == "bgpo" and j["seed"] == job["seed"]]
    folders = [job["folder"] for job in jobs if job["folder"]]
    if len(set(folders)) < len(folders):
        raise ValueError("two arms would write one folder: with these flags they are the same run")
    return jobs

def run_jobs(jobs, workers, threads):
    """Run the jobs not done yet, `workers` at a time, each a `threads`-thread process, in order as their
    dependencies allow, from this directory (so that a relative --out-dir means the same here and there).
    Returns the names of the jobs that failed, and of those that waited for them."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    todo, running, failed = [j for j in jobs if not j["done"]], [], []
    while todo or running:
        for job, process, log, t0 in list(running):
            if process.poll() is None:
                continue
            running.remove((job, process, log, t0))
            log.close()
            job["done"] = process.returncode == 0
            print(f"{'done' if job['done'] else 'FAILED'} {job['name']} in {time.time() - t0:.0f} s"
                  + ("" if job["done"] else f" (exit {process.returncode}; see {job['log']})"), flush=True)
            if not job["done"]:
                failed.append(job["name"])
        for job in list(todo):
            if any(dep["name"] in failed for dep in job["after"]):
                todo.remove(job)
                failed.append(job["name"])
                print(f"skipped {job['name']}: a job it needs failed", flush=True)
            elif len(running) < workers and all(dep["done"] for dep in job["after"]):
                todo.remove(job)
                os.makedirs(os.path.dirname(job["log"]) or ".", exist_ok=True)
                log = open(job["log"], "a")
                print(f"start {job['name']}: python {' '.join(job['argv'])}", flush=True)
                process = subprocess.Popen([sys.executable, *job["argv"]], env=env, stdout=log,
                                           stderr=subprocess.STDOUT)
                running.append((job, process, log, time.time()))
        time.sleep(0.2)
    return failed

# -----------------------------------------------------------------------------
# The table and the figure, from the runs' files

MEASURES = {"accuracy": "greedy accuracy (%)", "pass@32": "pass@32 (%) at the rollout temperature",
            "entropy": "entropy (nats per position) of the policy",
            "new solves": "new solves (%), right greedily and never in the SFT model's lab.reach samples,"}

def read_finals(jobs, size):
    """{arm: {seed: final.json}} of the finished runs scored on `size` problems, with pass@32 (of the final
    model and the SFT model) as keys of their own where the run scored it."""
    finals = {}
    for job in jobs:
        path = os.path.join(job["folder"] or "", "final.json")
        final = json.load(open(path)) if job.get("arm") and os.path.isfile(path) else None
        if final and final["size"] == size:
            for prefix in ("", "sft_"):
                if prefix + "pass_at_k" in final:
                    final[prefix + "pass@32"] = final[prefix + "pass_at_k"][str(rl.PASS_SAMPLES)]
            reach = os.path.join(job["folder"], "reach.json")   # lab.reach --reference's, where it ran
            solves = json.load(open(reach)).get("new_solves") if os.path.isfile(reach) else None
            if solves:
                final["new solves"], final["reach_problems"] = sum(solves) / len(solves), len(solves)
                final["sft_new solves"] = 0.0   # by definition
            finals.setdefault(job["arm"], {})[job["seed"]] = final
    return finals

def table(finals, reference, measure="accuracy"):
    """Rows: (arm, seeds, mean of the measure and half-width, paired difference from the SFT model, from
    reference); the SFT model's row first. Pairs use the seeds that both arms have; runs without the measure
    (scored before it existed) are left out."""
    finals = {arm: {s: f for s, f in runs.items() if measure in f} for arm, runs in finals.items()}
    finals = {arm: runs for arm, runs in finals.items() if runs}
    if not finals:   # no run scored it (--pass-at-k-size 0: no pass@32)
        return []
    sft = {seed: f["sft_" + measure] for arm in finals.values() for seed, f in arm.items()}   # one per seed
    rows = [("SFT model", sorted(sft), interval(list(sft.values())), None, None)]
    for arm, runs in finals.items():
        seeds = sorted(runs)
        value = {s: runs[s][measure] for s in seeds}
        ref = finals.get(reference, {})
        paired = [s for s in seeds if s in ref]
        rows.append((arm, seeds, interval([value[s] for s in seeds]),
                     interval([value[s] - runs[s]["sft_" + measure] for s in seeds]),
                     interval([value[s] - ref[s][measure] for s in paired])
                     if paired and arm != reference else None))
    return rows

def print_table(rows, reference, size, measure="accuracy", when=""):
    percent = measure != "entropy"
    where = (f"on the first {size} of those" if measure == "pass@32" else f"on {size} problems") + when
    print(f"\n{MEASURES[measure]} {where}, mean over seeds [95% interval, Student t]; differences paired by "
          f"seed\n{'arm':<14} {'seeds':<11} {measure:<22} {'minus SFT model':<22} minus {reference}")
    for arm, seeds, value, minus_sft, minus_ref in rows:
        print(f"{arm:<14} {','.join(map(str, seeds)):<11} {show(*value, percent=percent):<22} "
              f"{show(*minus_sft, signed=True, percent=percent) if minus_sft else '':<22} "
              f"{show(*minus_ref, signed=True, percent=percent) if minus_ref else ''}")

def finished_logs(jobs):
    """(job, its log.jsonl records) for each finished arm run (its final.json written)."""
    for job in jobs:
        if job.get("arm") and os.path.isfile(os.path.join(job["folder"], "final.json")):
            yield job, read_log(os.path.join(job["folder"], "log.jsonl"))

def curves(jobs, key="accuracy"):
    """{arm: {step: {seed: value}}} of a logged quantity at the finished runs' progress evaluations
    (log.jsonl): "accuracy", or "eval_entropy"."""
    out = {}
    for job, records in finished_logs(jobs):
        for r in records:
            if key in r:
                out.setdefault(job["arm"], {}).setdefault(r["step"], {})[job["seed"]] = r[key]
    return out

def parse_at_step(text, arms, reference):
    """--at-step: "600" (every arm at RL step 600) or "bgpo=1200,dyn=550" (each arm named at its step; the
    reference among them) -> {arm: step}."""
    if text.isdigit():
        return {arm: int(text) for arm in arms}
    steps = {}
    for part in text.split(","):
        arm, _, step = part.partition("=")
        if arm not in arms or arm in steps or not step.isdigit():
            raise ValueError(f"--at-step must be like 600 or {reference}=1200,ARM=550 with ARM of --arms, "
                             f"got {text!r}")
        steps[arm] = int(step)
    if reference not in steps:
        raise ValueError(f"--at-step {text} names no step for the reference, {reference}")
    return steps

def at_step(accuracy, steps):
    """read_finals' shape from the progress evaluations (accuracy: curves(jobs)): an arm's accuracy at RL step
    steps[arm], and its SFT model's, the evaluation at step 0."""
    return {arm: {seed: {"accuracy": value, "sft_accuracy": by_step[0][seed]}
                  for seed, value in by_step.get(steps[arm], {}).items()}
            for arm, by_step in accuracy.items() if arm in steps}

def diagnostics(jobs):
    """Per RL arm, means over seeds of what its runs logged (lab.rl's diagnostics) in the first and the last
    50 RL steps: where the signal comes from, how the update splits, where the seconds go."""
    fields = {"solve_groups": "solve groups (a solve and a miss)",
              "credit_only_groups": "groups differing by the 0.1 only", "solved": "rollouts solved",
              "informative_rows": "rows with A != 0", "never_solved": "groups drawn never solved",
              "always_solved": "groups drawn always solved", "sampler_batches": "sampler batches a step",
              "hinted_groups": "groups given a solve by a hint",
              "neg_over_pos": "|g-| / |g+|",
              "cos_pos_neg": "cos(g+, g-)", "rollout_share": "share of a step's seconds in rollouts"}
    per_arm = {}   # arm: {(field, "first" or "last"): [a mean per seed]}
    for job in jobs:
        path = os.path.join(job["folder"] or "", "log.jsonl")
        if not (job.get("arm") and ARMS[job["arm"]][0] == "lab.rl" and os.path.isfile(path)):
            continue
        steps = [r for r in read_log(path) if "grad_pos" in r]
        for r in steps:   # a part without rows logs 0: then there is no ratio or cosine to take
            r["neg_over_pos"] = r["grad_neg"] / r["grad_pos"] if r["grad_pos"] > 0 else math.nan
            r["cos_pos_neg"] = r["cos_pos_neg"] if r["grad_pos"] > 0 and r["grad_neg"] > 0 else math.nan
            r["rollout_share"] = r.get("rollout_seconds", math.nan) / r["seconds"]
        for part, chosen in (("first", steps[:50]), ("last", steps[-50:])):
            for key in fields:
                values = [r.get(key, math.nan) for r in chosen if not math.isnan(r.get(key, math.nan))]
                if values:
                    runs = per_arm.setdefault(job["arm"], {})
                    runs.setdefault((key, part), []).append(statistics.fmean(values))
    print("\nwhat the RL runs logged, mean over seeds: first 50 steps -> last 50 steps")
    print(f"{'':<38}" + "".join(f"{arm:>16}" for arm in per_arm))
    for key, label in fields.items():
        cells = []
        for runs in per_arm.values():
            first, last = runs.get((key, "first")), runs.get((key, "last"))
            cells.append(f"{statistics.fmean(first):.2f} -> {statistics.fmean(last):.2f}"
                         if first and last else "")
        print(f"{label:<38}" + "".join(f"{cell:>16}" for cell in cells))
    return per_arm

def band(values_by_x, offset=None):
    """A line with its band: per x, the mean over seeds of the values (minus offset[seed]) and its 95%
    interval."""
    xs = sorted(values_by_x)
    stats = [interval([v - (offset[seed] if offset else 0) for seed, v in values_by_x[x].items()])
             for x in xs]
    return {"x": xs, "y": [m for m, _ in stats], "style": "o-",
            "band": ([m - h for m, h in stats], [m + h for m, h in stats])}

def sweep_figure(arm_curves, entropy_curves=None, finals=None, eval_size=None):
    """Progress accuracy against the RL step (the runs' evaluations, on eval_size problems), per arm the mean
    over seeds and its 95% interval as a band: as it is, and minus the same seed's SFT model, step 0 (paired,
    so the SFT lottery cancels); then, where the runs have them, pass@k against k of the final models and the
    SFT model, and the entropy against the step."""
    panels = []
    problems = f" on {eval_size} problems" if eval_size else ""
    for title, paired in ((f"progress accuracy (%){problems}", False),
                          ("minus the seed's SFT model (points)", True)):
        lines = []
        for arm, by_step in arm_curves.items():
            percent = {step: {seed: 100 * v for seed, v in values.items()}
                       for step, values in by_step.items()}
            lines.append({"label": f"{arm} ({len(by_step[max(by_step)])} seeds)",
                          **band(percent, percent[0] if paired else None)})
        panels.append({"title": f"{title}: mean over seeds, 95% interval", "lines": lines,
                       "xlabel": "RL step" + (" (sft-continued: the same training seconds)"
                                              if "sft-continued" in arm_curves else "")})
    reach = {}   # label: {k: {seed: pass@k in percent}}
    for arm, runs in (finals or {}).items():
        for seed, f in runs.items():
            for label, prefix in (("SFT model", "sft_"), (arm, "")):
                for k, v in f.get(prefix + "pass_at_k", {}).items():
                    reach.setdefault(label, {}).setdefault(int(k), {})[seed] = 100 * v
    if reach:
        panels.append({"title": "pass@k at the rollout temperature (%), final models", "xlabel": "k",
                       "xscale": "log",
                       # the arms in the other panels' colours, the SFT model grey and dashed
                       "lines": [{"label": label, **band(by_k)} for label, by_k in reach.items()
                                 if label != "SFT model"]
                       + [{"label": "SFT model", "color": "grey", "style": "--",
                           **band(reach["SFT model"])}]})
    if entropy_curves:
        panels.append({"title": "entropy on the progress problems (nats per position)", "xlabel": "RL step",
                       "lines": [{"label": arm, **band(by_step)} for arm, by_step in entropy_curves.items()]})
    return {"panels": panels, "width": 11, "rows": 1 if len(panels) <= 2 else 2}

def mc_samples_arms(arms, flags):
    """{arm: n_t} of the arms that differ from bgpo by --mc-samples alone (bgpo's n_t: the flags')."""
    return {arm: rl.parse_args([*flags, *ARMS[arm][1]]).mc_samples for arm in arms
            if ARMS[arm][0] == "lab.rl" and ARMS[arm][1][::2] in ([], ["--mc-samples"])}

def step_costs(jobs):
    """{arm: {seed: {"update_s", "activation_mb"}}}: per finished run, the medians over its RL steps of the
    seconds outside the rollouts (the update, its MC draws, the log's one entropy pass) and of the update's
    activations (the meter's peak; a step without an update logs 0 and is left out)."""
    out = {}
    for job, records in finished_logs(jobs):
        steps = [r for r in records if "rollout_seconds" in r]
        if steps:
            out.setdefault(job["arm"], {})[job["seed"]] = {
                "update_s": statistics.median(r["seconds"] - r["rollout_seconds"] for r in steps),
                "activation_mb": statistics.median([r["activation_mb"] for r in steps if r["activation_mb"]]
                                                   or [0.0])}
    return out

def nt_figure(finals, costs, n_t_of, reference):
    """The final test accuracy against n_t (mean over seeds, 95% band; and minus reference, paired by
    seed), and the seconds of a step's update against n_t: the arms that differ by n_t alone (n_t_of)."""
    arms = sorted((arm for arm in n_t_of if arm in finals), key=n_t_of.get)
    by_x = lambda value: {n_t_of[arm]: {seed: value(arm, seed) for seed in finals[arm]} for arm in arms}
    accuracy = by_x(lambda arm, seed: 100 * finals[arm][seed]["accuracy"])
    sft = by_x(lambda arm, seed: 100 * finals[arm][seed]["sft_accuracy"])
    ref = finals.get(reference, {})
    minus = {n_t_of[arm]: {s: 100 * (f["accuracy"] - ref[s]["accuracy"]) for s, f in finals[arm].items()
                           if s in ref} for arm in arms}
    seconds = {n_t_of[arm]: {s: c["update_s"] for s, c in costs.get(arm, {}).items()} for arm in arms}
    log2 = {"xlabel": "MC samples n_t", "xscale": "log", "xticks": [n_t_of[arm] for arm in arms]}
    return {"panels": [
        {"title": "test accuracy (%) after RL: mean over seeds, 95% interval", **log2,
         "lines": [{"label": "RL", **band(accuracy)},
                   {"label": "SFT model", "color": "grey", "style": "--", **band(sft)}]},
        {"title": f"minus n_t {n_t_of[reference]} (points), paired by seed", **log2,
         "lines": [{"label": "RL", **band({x: v for x, v in minus.items() if len(v) > 1})}]},
        {"title": "seconds of a step outside the rollouts (median over steps)", **log2,
         "lines": [{"label": "update", **band({x: v for x, v in seconds.items() if v})}]}]}

# -----------------------------------------------------------------------------
# The command line

def parse_seeds(text):
    """"0-4" or "0,2,5" -> a list of distinct seeds, in order."""
    seeds = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if not (low.strip().isdigit() and (not high or high.strip().isdigit())):
            raise ValueError(part)
        if high and int(high) < int(low):
            raise ValueError(part)
        seeds += range(int(low), int(high or low) + 1)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(text)
    return seeds

def main(argv=None):
    p = cli.ArgumentParser(prog="python -m lab.sweep", description=__doc__.strip().split("\n\n")[0],
                           allow_abbrev=False,   # --seed must not pass for --seeds
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           epilog="Any other flag is bgpo.py's or lab.rl's and goes to every run. Arms: "
                           + "; ".join(f"{arm}: python -m {module} {' '.join(flags)}".strip()
                                       for arm, (module, flags) in ARMS.items()))
    a = p.add_argument
    a("--seeds", default="0-4", help="seeds, as 0-4 or 0,2,5")
    a("--arms", default="bgpo,rft,sft-continued,nt1,neg-weight-1", help=f"arms, from {', '.join(ARMS)}")
    a("--reference", default="bgpo", help="the arm that the table's last column subtracts")
    a("--workers", type=int, default=2, help="runs at a time")
    a("--threads", type=int, default=1, help="threads per run (OMP_NUM_THREADS)")
    a("--final-eval-size", type=int, default=2000, help="test problems for the table's final evaluations")
    a("--pass-at-k-size", type=int, default=100,
      help=f"of those, the first N also get pass@k from {rl.PASS_SAMPLES} samples each at the rollout "
           "temperature")
    a("--png", default=None, help="the figure's path (None: sweep.png in --out-dir); needs matplotlib")
    a("--table-only", action="store_true", help="read the finished runs, run nothing")
    a("--at-step", action="append", default=[],
      help="also the table at an RL step's progress evaluation: 600, or bgpo=1200,ARM=550 (repeatable)")
    args, flags = p.parse_known_args(argv)
    try:
        args.seeds = parse_seeds(args.seeds)
    except ValueError:
        p.error(f"--seeds must be like 0-4 or 0,2,5 (distinct, >= 0), got {args.seeds!r}")
    args.arms = args.arms.split(",")
    for arm in args.arms + [args.reference]:
        if arm not in ARMS:
            p.error(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")
    if args.reference not in args.arms:
        p.error(f"--reference {args.reference} is not one of --arms {','.join(args.arms)}")
    if len(set(args.arms)) != len(args.arms):
        p.error(f"--arms names an arm twice: {','.join(args.arms)}")
    if "sft-continued" in args.arms and "bgpo" not in args.arms:
        p.error("the sft-continued arm trains for the seconds of the bgpo arm's run: add bgpo to --arms")
    for name in ("workers", "threads", "final_eval_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if not 0 <= args.pass_at_k_size <= args.final_eval_size:
        p.error(f"--pass-at-k-size must be in 0..--final-eval-size ({args.final_eval_size}), "
                f"got {args.pass_at_k_size}")
    # an unknown or bad flag: one line and exit 2 here, not in a worker
    given, defaults = (vars(rl.make_parser().parse_args(f)) for f in (flags, []))
    for name in ("seed", "stage", "resume", "overwrite", "run_name", "prompt", "bench_memory"):
        if given[name] != defaults[name]:   # read as parsed, so that an abbreviation cannot slip through
            p.error(f"--{name.replace('_', '-')} is the sweep's to set, not a flag to pass to every run")
    try:
        jobs = plan(args, flags)
        at_steps = [parse_at_step(text, args.arms, args.reference) for text in args.at_step]
    except ValueError as e:
        p.error(str(e))
    run_args = rl.parse_args(flags)   # what every run is given
    for steps in at_steps:
        for arm, step in steps.items():
            if step > run_args.rl_steps or (step % run_args.eval_every and step != run_args.rl_steps):
                p.error(f"--at-step: {arm}'s step {step} is not an evaluation; the runs evaluate every "
                        f"{run_args.eval_every} RL steps to {run_args.rl_steps}")
    out_dir = run_args.out_dir
    print(f"sweep: {len(args.seeds)} seeds x {len(args.arms)} arms, {args.workers} workers x {args.threads} "
          f"thread(s); {sum(not j['done'] for j in jobs)} of {len(jobs)} jobs to run", flush=True)
    t0 = time.time()
    failed = [] if args.table_only else run_jobs(jobs, args.workers, args.threads)
    finals = read_finals(jobs, args.final_eval_size)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    if not finals:
        print("no finished run to tabulate")
        sys.exit(1 if failed else 0)
    rows = table(finals, args.reference)
    print(f"\nruns read ({time.time() - t0:.0f} s for this sweep command):")
    for job in jobs:
        if job.get("arm") and job["seed"] in finals.get(job["arm"], {}):
            print(f"  {job['folder']}: python {' '.join(job['argv'])}")
    any_final = next(iter(next(iter(finals.values())).values()))
    print_table(rows, args.reference, any_final["size"])
    reached = [final["reach_problems"] for runs in finals.values() for final in runs.values()
               if "reach_problems" in final]
    for measure, size in (("pass@32", any_final.get("pass_at_k_size")), ("entropy", any_final["size"]),
                          ("new solves", reached[0] if reached else 0)):
        more = table(finals, args.reference, measure)
        if len(more) > 1:
            print_table(more, args.reference, size, measure)
    accuracy = curves(jobs)
    for steps in at_steps:
        named = (f"RL step {next(iter(steps.values()))}" if len(set(steps.values())) == 1 else
                 "RL steps " + ", ".join(f"{arm} {step}" for arm, step in steps.items()))
        print_table(table(at_step(accuracy, steps), args.reference), args.reference, run_args.eval_size,
                    when=f", the progress evaluation at {named}")
    diagnostics(jobs)
    png = args.png or os.path.join(out_dir, "sweep.png")
    draw(sweep_figure(accuracy, curves(jobs, "eval_entropy"), finals, run_args.eval_size), png)
    n_t_of = mc_samples_arms(args.arms, flags)
    if len(n_t_of) >= 3 and args.reference in n_t_of:   # a curve in n_t: its table and figure
        costs = step_costs(jobs)
        print(f"\nagainst n_t, medians over a run's steps, mean over seeds: the seconds outside the rollouts "
              f"and BGPO's activations\n{'arm':<14} {'n_t':>4} {'update s':>9} {'act MiB':>8}")
        for arm in sorted((arm for arm in costs if arm in n_t_of), key=n_t_of.get):
            update, act = ([c[key] for c in costs[arm].values()] for key in ("update_s", "activation_mb"))
            print(f"{arm:<14} {n_t_of[arm]:>4} {statistics.fmean(update):>9.2f} "
                  f"{statistics.fmean(act):>8.1f}")
        draw(nt_figure(finals, costs, n_t_of, args.reference), os.path.splitext(png)[0] + "_nt.png")
    if not args.table_only:   # the record of the sweep that ran
        cli.write_json(os.path.join(out_dir, "sweep.json"),
                        {"command": sys.argv, "rows": rows, "finals": finals, "failed": failed})
    if failed:
        sys.exit(1)
    return rows

if __name__ == "__main__":
    main()
