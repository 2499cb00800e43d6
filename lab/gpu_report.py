"""
The GPU report: one command that makes the measurements the README's GPU lines need, on the card it runs on,
in at most --minutes (8: a lent machine's session), with its logs and a short report in one folder of at
most 8 files.

    python -m lab.gpu_report [--out DIR]    # on a machine with a CUDA GPU (DIR: $OUT, else out/gpu_report)
    python -m lab.gpu_report --dry-run      # the same commands with tiny flags, on the CPU (tests run each)

What it runs, each with a time limit, the GPU's memory capped at 24 GiB (a consumer card on a bigger one):
1. alone, so that its timings are the card's (at most 1, 1, 1 and 4 minutes; on an H200 the first 16 s, the
   last 2 min):
   - `python -m lab.bench_step --size gpu --cap-gib 24`: seconds per RL step of bgpo.py's path against the
     float32 path it replaced, MFU, ops and syncs by phase, a profile of one step (the host's time against
     the GPU's); then with the sampler replayed as a CUDA graph (`--graphs`), and with 25% of the groups mixed
     and only their rows updated (`--mixed 0.25 --skip-tied`) (bench.log);
   - `python -m lab.capped 24 bgpo.py`: the card's command, Countdown at the GPU size (`--size auto` on CUDA),
     SFT then RL (countdown.log);
2. side by side in the time left, one log file's commands after each other (timings shared with the rest):
   - `python -m pytest -q` (pytest.log);
   - `bgpo.py --bench-memory` under the cap: where the naive update runs out; then 20 RL steps
     under `torchrun --nproc_per_node=1` (the launcher's path: one process makes no collective, so NCCL's
     all-reduce needs two GPUs) (memory.log);
   - `bgpo.py --task arithmetic` and `--task sudoku`, cut at the time limit (arithmetic.log,
     sudoku.log);
   - Countdown again with `--demos 0` (SFT on fresh demonstrations every step): one run, a screen of what
     stands between the GPU size and 50% test accuracy (after the first in countdown.log).
The dry run runs each kind of command once (not the other two tasks, nor --graphs), side by side.
The GPU's utilisation is sampled every 0.5 s (nvidia-smi, util.csv); report.md gives, for each command, its
exit status, seconds, mean utilisation and the lines that carry its result.
"""
import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

import bgpo
from lab import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the commands run from the repository

# flags that shrink every run to seconds on the CPU (flags given win over --size gpu's)
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--demos", "20", "--sft-steps", "2",
        "--sft-eval-every", "2", "--val-size", "4", "--eval-size", "4", "--prompts-per-step", "2",
        "--group-size", "2", "--mc-samples", "2", "--rl-steps", "2", "--eval-every", "1", "--device", "cpu"]

def commands(runs_dir, dry_run):
    """[(phase, log file, name, argv)]: phase 1 runs alone and in order, phase 2 side by side."""
    py, tiny = sys.executable, TINY if dry_run else []
    # bgpo.py without --size: on CUDA the default, auto, is the GPU size (the dry run on the CPU names it)
    bgpo_py = [py, "-m", "lab.capped", "24", "bgpo.py", "--out-dir", runs_dir] + ["--size", "gpu"] * dry_run
    bench = [py, "-m", "lab.bench_step", "--size", "gpu", "--cap-gib", "24", "--steps", "10", "--warmup", "3"]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "bgpo.py", "--size",
                "gpu", "--out-dir", runs_dir, "--rl-steps", "20", "--run-name", "torchrun_first_steps"]
    pytest = [py, "-m", "pytest", "-q"] + (["--version"] if dry_run else [])   # dry run: does pytest start?
    if dry_run:   # each kind of command once, side by side (its timings mean nothing), in seconds
        return [(2, "bench.log", "bench_step", bench + tiny + ["--steps", "1", "--warmup", "0", "--profile"]),
                (2, "countdown.log", "countdown", bgpo_py + tiny),
                (2, "memory.log", "bench-memory", bgpo_py + ["--bench-memory"] + tiny),
                (2, "memory.log", "torchrun", torchrun + tiny), (2, "pytest.log", "pytest", pytest)]
    return [(1, "bench.log", "bench_step", bench + ["--profile"]),
            (1, "bench.log", "bench_step --graphs", bench + ["--graphs"]),   # after the first, in its log
            # every row updated (the GPU size's fixed shape) against the rows of the 25% of groups that differ
            (1, "bench.log", "bench_step --skip-tied", bench + ["--mixed", "0.25", "--skip-tied"]),
            (1, "countdown.log", "countdown", bgpo_py),
            (2, "pytest.log", "pytest", pytest),
            (2, "memory.log", "bench-memory", bgpo_py + ["--bench-memory"]),
            (2, "memory.log", "torchrun", torchrun),   # after the memory table, in its log
            # a screen for the 50% goal (seed 0, one run): SFT on fresh demonstrations every step, not 2,000
            (2, "countdown.log", "countdown --demos 0",
             bgpo_py + ["--demos", "0", "--run-name", "countdown_fresh_demos_gpu"]),
            (2, "arithmetic.log", "arithmetic", bgpo_py + ["--task", "arithmetic"]),
            (2, "sudoku.log", "sudoku", bgpo_py + ["--task", "sudoku"])]

# the lines of a log that carry a command's result
RESULT = re.compile(r"^(model .*|  s/step.*|profile of .*|  longest on .*|torch.compile: .*|"
                    r"\s*[\d.]+\s+[\d.]+x .*| n_t \|.*|\s+\d+ \| .*|"
                    r"kept the SFT model.*|test accuracy .*|\(\S+: \d+ s on .*|RL step +\d+ .*test acc.*|"
                    r"warning: .*|"
                    r".*(passed|failed|error).*|pytest \d.*|.*Error.*)$")

def result_lines(text, most=14):
    lines = [line for line in text.splitlines() if RESULT.match(line)]
    return lines if len(lines) <= most else lines[:4] + ["..."] + lines[-(most - 5):]

def own_part(text, argv):
    """The part of a log, which other commands may share, that argv's command wrote (from its "$ " line)."""
    first = text.rfind(f"$ {shlex.join(argv)}\n")   # the whole line: one command's may begin another's
    after = text.find("\n$ ", first + 1)
    return text[first:after if after >= 0 else len(text)]

def utilisation(samples, start, end):
    """The mean GPU utilisation (%) of the samples (time, percent) taken between start and end, or None."""
    inside = [u for t, u in samples if start <= t <= end]
    return sum(inside) / len(inside) if inside else None

def read_samples(path):
    samples = []
    for line in open(path) if os.path.isfile(path) else []:
        try:
            t, u = line.split(",")[:2]
            samples.append((float(t), float(u)))
        except ValueError:
            continue
    return samples

def start(argv, log_path, env):
    log = open(log_path, "a")
    log.write(f"$ {shlex.join(argv)}\n")
    log.flush()
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log

def finish(process, log, deadline):
    """Wait for process until deadline (time.time()); past it, stop it. Returns its exit code, or None."""
    try:
        code = process.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
    log.write(f"[{'stopped at the time limit' if code is None else f'exit code {code}'}]\n")
    log.close()
    return code

def main(argv=None):
    p = cli.ArgumentParser(prog="python -m lab.gpu_report", description=__doc__.strip().split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join("out", "gpu_report"),
                   help="the folder of the logs and report.md (at most 8 files)")
    p.add_argument("--minutes", type=float, default=8.0, help="the whole report's time limit")
    p.add_argument("--dry-run", action="store_true", help="tiny flags on the CPU: does every command run?")
    args = p.parse_args(argv)
    if not args.minutes > 0:
        p.error(f"--minutes must be positive, got {args.minutes}")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA GPU here (a CPU build of PyTorch?); --dry-run runs the commands on the CPU")
    os.makedirs(args.out, exist_ok=True)
    runs_dir = tempfile.mkdtemp(prefix="gpu_report_runs_")   # checkpoints: not among the files sent back
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": "1"} if args.dry_run else {})}
    t0 = time.time()
    end = t0 + 60 * args.minutes - 20   # 20 s for the report and the cleaning up
    smi = shutil.which("nvidia-smi") and not args.dry_run
    sampler = subprocess.Popen(
        ["bash", "-c", "while sleep 0.5; do echo \"$(date +%s.%N),$(nvidia-smi --query-gpu=utilization.gpu,"
                       "memory.used --format=csv,noheader,nounits | head -1)\"; done"],
        stdout=open(os.path.join(args.out, "util.csv"), "w")) if smi else None
    done = []   # (name, argv, log, code, start, end)
    planned = commands(runs_dir, args.dry_run)
    limits = {"bench_step": 60, "bench_step --graphs": 60, "bench_step --skip-tied": 60, "countdown": 240}
    for phase, log, name, argv in [c for c in planned if c[0] == 1]:
        began = time.time()
        process, handle = start(argv, os.path.join(args.out, log), env)
        code = finish(process, handle, min(end, began + limits[name]))
        done.append((name, argv, log, code, began, time.time()))
    # phase 2: one thread a log file, side by side; the commands of a log one after the other
    def run_in_order(log, group):
        for _, _, name, argv in group:
            began = time.time()
            code = finish(*start(argv, os.path.join(args.out, log), env), end)
            done.append((name, argv, log, code, began, time.time()))
    groups = {}
    for command in [c for c in planned if c[0] == 2]:
        groups.setdefault(command[1], []).append(command)
    threads = [threading.Thread(target=run_in_order, args=(log, group)) for log, group in groups.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if sampler:
        sampler.kill()
    order = [c[2] for c in planned]
    done.sort(key=lambda d: order.index(d[0]))
    samples = read_samples(os.path.join(args.out, "util.csv"))
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    how_run = ("Every command ran side by side (a dry run)." if args.dry_run
               else "Phase 1 (three bench_step, countdown) ran alone; the rest side by side.")
    lines = [f"# GPU report: {device}", "",
             f"PyTorch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPU cores, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, {time.time() - t0:.0f} s in all "
             f"(limit {args.minutes:g} min). " + how_run, ""]
    for name, argv, log, code, began, ended in done:
        util = utilisation(samples, began, ended)
        status = "stopped at the time limit" if code is None else f"exit code {code}"
        busy = "" if util is None else f", GPU {util:.0f}% busy"
        lines += [f"## {name}: {status}, {ended - began:.0f} s{busy}",
                  "", f"`{shlex.join(argv[1:])}` ({log})", "", "```"]
        lines += result_lines(own_part(open(os.path.join(args.out, log)).read(), argv)) + ["```", ""]
    report = "\n".join(lines)
    bgpo.write_text(os.path.join(args.out, "report.md"), report)
    shutil.rmtree(runs_dir, ignore_errors=True)
    print(report)
    return done

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.gpu_report")
