"""
The lab's command line: bgpo.py's flags, and flags for what the tutorial fixes as constants (its rollout
temperature, the weight of negative advantages, the RL learning rate and PPO clip) or does not have
(learning-rate warmup, several passes over a rollout batch, the sampler's steps and blocks, the memory
tables' repeats). Every default is the tutorial's: the lab has one default regime, bgpo.py's.
Every lab command builds its parser here, checks it with check_args and runs under command_line.
"""
import argparse
import hashlib
import json
import math
import os
import subprocess
import sys

import torch

import bgpo
from tasks import get_task

class ArgumentParser(argparse.ArgumentParser):
    """A copy of bgpo.py's ArgumentParser: an error is one line and exit code 2, without the usage dump."""
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

def make_parser(prog, description):
    """bgpo.make_parser()'s flags, then the lab's. A lab command may add a flag again to replace one."""
    p = ArgumentParser(prog=prog, description=description, parents=[bgpo.make_parser()], add_help=False,
                       conflict_handler="resolve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    # what bgpo.py fixes as constants, and what it does not have
    a("--temperature", type=float, default=bgpo.TEMPERATURE, help="rollout temperature; evaluation is greedy")
    a("--neg-weight", type=float, default=bgpo.NEG_WEIGHT, help="weight of negative advantages, in [0, 1]")
    a("--rl-lr", type=float, default=bgpo.RL_LR, help="RL learning rate")
    a("--rl-warmup", type=int, default=0, help="RL steps of linear learning-rate warmup")
    a("--clip-eps", type=float, default=bgpo.CLIP_EPS, help="PPO clip, used when off-policy")
    a("--updates-per-batch", type=int, default=1, help="passes over a rollout batch (epochs); 1: on-policy")
    a("--gen-steps", type=int, default=None, help="sampler steps (None: L, one token per step)")
    a("--block-len", type=int, default=None, help="sampler block length (None: L, one block)")
    a("--bench-repeats", type=int, default=3, help="update steps timed per row of a memory table")
    return p

# The flags that name a lab run in words, and those that change where it is written or how it is read or
# shown, not what it computes (bgpo.py's, then the lab's); every other flag that differs from its default
# goes into the run's name as a hash. bgpo.py names its runs in words only.
IN_WORDS = ("task", "objective", "mc_samples", "minibatches", "seed")
# --mc-chunk names a lab run (not bgpo.py's): the lab compares runs that differ by it alone (rounding)
NOT_RESULTS = tuple(n for n in bgpo.NOT_RESULTS if n != "mc_chunk") + (
    "plot", "bench_repeats", "final_eval_size", "pass_at_k_size", "track_answers", "size", "dtype",
    "skip_tied")   # lab: bgpo.py's defaults

def settings_hash(p, args):
    """"_" and a short hash of every other flag of p that differs from its default ("" if none): two lab
    commands that would compute different runs do not share a folder (--demos 200 and --rl-steps 500 each
    get their own; --device does not enter the name, and run.json records it)."""
    given = {**vars(args), "demos": bgpo.DEMOS[args.task] if args.demos is None else args.demos}
    defaults = {**vars(p.parse_args([])), "demos": bgpo.DEMOS[args.task]}
    changed = {name: value for name, value in sorted(given.items()) if name in defaults
               and name not in IN_WORDS + NOT_RESULTS and value != defaults[name]}
    return "_" + hashlib.sha1(repr(changed).encode()).hexdigest()[:6] if changed else ""

def describe_run(args):
    """What bgpo.run_rl writes to run.json (the command, the flags, the machine) and the code's commit: a lab
    run's run.json."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                cwd=os.path.dirname(bgpo.__file__) or ".", timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"command": sys.argv, "flags": vars(args), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "commit": commit or None}

def write_json(path, obj):
    """A run's JSON record, written as bgpo.py writes its files: a temporary file, then rename."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    bgpo.write_text(path, json.dumps(obj, indent=1))

def check_args(p, args):
    """The lab's flags checked (p.error: one line, exit code 2), then bgpo.py's by bgpo.check_args, which also
    fills the derived defaults (--demos, --run-name, --device)."""
    L = get_task(args.task).gen_len
    blocks = math.ceil(L / min(max(args.block_len or L, 1), L))
    for ok, message in [
            (math.isfinite(args.temperature) and args.temperature >= 0,
             f"--temperature must be >= 0, got {args.temperature}"),
            (0 <= args.neg_weight <= 1, f"--neg-weight must be in [0, 1], got {args.neg_weight}"),
            (math.isfinite(args.rl_lr) and args.rl_lr > 0, f"--rl-lr must be positive, got {args.rl_lr}"),
            (args.clip_eps is None or (math.isfinite(args.clip_eps) and args.clip_eps > 0),
             f"--clip-eps must be positive, got {args.clip_eps}"),
            (args.rl_warmup >= 0, f"--rl-warmup must be an integer >= 0, got {args.rl_warmup}"),
            (args.updates_per_batch is None or args.updates_per_batch >= 1,
             f"--updates-per-batch must be a positive integer, got {args.updates_per_batch}"),
            (args.bench_repeats >= 1,
             f"--bench-repeats must be a positive integer, got {args.bench_repeats}"),
            (args.block_len is None or 1 <= args.block_len <= L,
             f"--block-len must be in 1..{L} (the completion length of {args.task}), got {args.block_len}"),
            (args.gen_steps is None or blocks <= args.gen_steps <= L,
             f"--gen-steps must be in {blocks}..{L} (a step per block at least), got {args.gen_steps}")]:
        if not ok:
            p.error(message)
    if args.size == "gpu" or args.dtype == "bfloat16" or not args.skip_tied:
        p.error("--size gpu, --dtype bfloat16 and --no-skip-tied are bgpo.py's: the lab runs float32, its "
                "sizes flag by flag, and leaves tied groups out")
    args.size = "cpu"   # --size auto too: the CPU size's defaults on every device
    # bgpo.check_args sees bgpo.py's flags only (it may check every one it is given), then fills args
    named = args.run_name is not None
    tutorial = argparse.Namespace(**{k: getattr(args, k) for k in vars(bgpo.make_parser().parse_args([]))})
    tutorial.dtype = "float32"   # bgpo.main's autocast is not the lab's: its runs record what they run
    tutorial.device = bgpo.pick_device(p, args.device)[0]
    vars(args).update(vars(bgpo.check_args(p, tutorial)))
    if not named:   # bgpo.py's name and a hash of the other flags (the lab's too), as lab.rl names a run
        common = make_parser("", "")
        shared = argparse.Namespace(**{k: getattr(args, k) for k in vars(common.parse_args([]))
                                       if k not in NOT_RESULTS})
        mb = f"_mb{args.minibatches}" if args.minibatches > 1 else ""
        args.run_name = (f"{args.task}_{args.objective}_nt{args.mc_samples}{mb}_seed{args.seed}"
                         + settings_hash(common, shared))
    if args.world > 1:
        p.error("the lab runs in one process (python -m lab...), not under torchrun")
    return args

def command_line(main, prog):
    """Run main(); a missing or wrong checkpoint or a diverged run (bgpo.RunError) prints one line and
    exits with code 2, as bgpo.py's does."""
    try:
        return main()
    except bgpo.RunError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
