"""
The lab's command line: bgpo.py's flags, and flags for what the tutorial fixes as constants (its rollout
temperature, the weight of negative advantages, the RL learning rate and PPO clip) or does not have
(learning-rate warmup, several passes over a rollout batch, the sampler's steps and blocks, the memory
tables' repeats). Every default is the tutorial's: the lab has one default regime, bgpo.py's.
Every lab command builds its parser here, checks it with check_args and runs under command_line.
"""
import argparse
import math
import sys

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

# lab flags that change what is shown, not a run
NOT_RESULTS = ("plot", "bench_repeats", "final_eval_size", "pass_at_k_size")

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
    # bgpo.check_args sees bgpo.py's flags only (it may check every one it is given), then fills args
    named = args.run_name is not None
    tutorial = argparse.Namespace(**{k: getattr(args, k) for k in vars(bgpo.make_parser().parse_args([]))})
    vars(args).update(vars(bgpo.check_args(p, tutorial)))
    if not named:   # bgpo.py's name, with the lab's shared flags in its hash, as python -m lab.rl names a run
        common = make_parser("", "")
        shared = argparse.Namespace(**{k: getattr(args, k) for k in vars(common.parse_args([]))
                                       if k not in NOT_RESULTS})
        k = f"_k{args.minibatches}" if args.minibatches > 1 else ""
        args.run_name = (f"{args.task}_{args.objective}_nt{args.mc_samples}{k}_seed{args.seed}"
                         + bgpo.settings_hash(common, shared))
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
