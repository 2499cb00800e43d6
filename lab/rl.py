"""
bgpo.py's RL loop with the field's objectives and the lab's diagnostics:

    python -m lab.rl --objective {bgpo,naive,diffu-grpo,stp,dtrpo,trajectory} [any bgpo.py flag] [lab flags]

What the lab adds to bgpo.run_rl, all through its plug-in points (an Objective and an on_step hook):
1. The field's objectives (lab/objectives.py), with their own defaults: d1's and STP's mu = 4 inner
   updates, d1's clip 0.5, STP's num_t = 3 (--mc-samples) and early stop 0.75 (--stp-tau).
2. Options: --remasking random (rollouts whose exact policy gradient is known), --d1-advantages,
   --no-anchors, --rl-pool N (practise on a fixed pool of N training problems and report the
   accuracy on them beside the held-out one).
3. Diagnostics in log.jsonl: the update is built in two parts, the rows with A > 0 and those with
   A < 0 (each part's A scaled by its share of the rows, so they add up to the same step), logged as
   grad_pos, grad_neg and their cosine cos_pos_neg; the policy's first-step prediction entropy; the
   sampler's forward passes per rollout (rollout_passes). Splitting the update changes the float
   summation order, so a run here differs from bgpo.py's by rounding, not by what it computes.
"""
import dataclasses
import os

import torch

import bgpo
import lab
from bgpo import evaluate, positive_float, positive_int, rows_of
from lab.figures import curves_figure, draw, read_log
from lab.objectives import OBJECTIVES, d1_advantages, flat_grad, lab_sampler
from tasks import get_task

FIELD = ("diffu-grpo", "stp", "dtrpo")  # d1, STP and dTRPO: mu = 4 inner updates by default

def make_parser():
    p = lab.make_parser("python -m lab.rl", "bgpo.py's SFT and RL with the field's objectives and the lab's diagnostics.")
    a = p.add_argument
    a("--objective", choices=list(OBJECTIVES), default="bgpo", help="BGPO, the naive objective, one of the field's methods (lab/objectives.py), or the trajectory control (default: %(default)s)")
    a("--mc-samples", type=positive_int, default=None, help="MC samples n_t per completion, for bgpo, naive and stp (default: 16; STP's num_t: 3)")
    a("--updates-per-batch", type=positive_int, default=None, help="optimizer steps per rollout batch (mu); 1 = on-policy (default: 1; 4 for diffu-grpo, stp, dtrpo)")
    a("--clip-eps", type=positive_float, default=None, help="PPO clip, used when --updates-per-batch > 1 (default: 0.2; d1's 0.5 for diffu-grpo)")
    a("--stp-tau", type=float, default=None, help="STP's early stop: fill the rest in one pass once this fraction of tokens is in place (default: 0.75 with --objective stp)")
    a("--no-anchors", action="store_true", help="STP without its spatial pruning (no anchors), for the ablation (default: %(default)s)")
    a("--d1-advantages", action="store_true", help="diffu-grpo with d1's advantage, reward minus group mean (default: z-scored, Eq. 18)")
    a("--remasking", choices=["low_confidence", "random"], default="low_confidence", help="which positions a rollout step commits: the most confident, or uniformly random ones (default: %(default)s)")
    a("--rl-pool", type=bgpo.non_negative_int, default=0, help="practise on a fixed pool of N training problems; 0 = fresh problems every step (default: %(default)s)")
    a("--plot", action="store_true", help="draw the run's curves as curves.png in its folder, if matplotlib is installed (default: %(default)s)")
    a("--run-name", default=None, help="RL run folder in --out-dir (default: task_objective[_ntM][_tauT][_noanchors][_d1adv][_random]_uK[_poolN]_seedS)")
    return p

def parse_args(argv=None):
    p = make_parser()
    args = p.parse_args(argv)
    for flag, given, objective in (("--stp-tau", args.stp_tau is not None, "stp"), ("--no-anchors", args.no_anchors, "stp"),
                                   ("--d1-advantages", args.d1_advantages, "diffu-grpo")):
        if given and args.objective != objective:
            p.error(f"{flag} is an option of --objective {objective}, not {args.objective}")
    if args.stp_tau is not None and not 0 < args.stp_tau <= 1:
        p.error(f"--stp-tau must be in (0, 1], got {args.stp_tau}")
    stp = args.objective == "stp"
    args.stp_tau = args.stp_tau or (0.75 if stp else None)
    args.mc_samples = args.mc_samples or (3 if stp else 16)
    args.updates_per_batch = args.updates_per_batch or (4 if args.objective in FIELD else 1)
    args.clip_eps = args.clip_eps or (0.5 if args.objective == "diffu-grpo" else 0.2)
    args.anchors = stp and not args.no_anchors and args.task == "sudoku"   # the other tasks have no anchors
    if args.objective == "trajectory" and args.updates_per_batch > 1:
        p.error("--objective trajectory is on-policy: use it with --updates-per-batch 1")
    if 0 < args.rl_pool < args.prompts_per_step:
        p.error(f"--rl-pool {args.rl_pool} is smaller than --prompts-per-step {args.prompts_per_step}")
    estimator = f"_nt{args.mc_samples}" if args.objective in ("bgpo", "naive", "stp") else ""  # the others draw no masked copies
    options = (f"_tau{args.stp_tau}" if args.stp_tau else "") + ("_noanchors" if args.no_anchors else "") + \
        ("_d1adv" if args.d1_advantages else "") + ("_random" if args.remasking == "random" else "")
    args.run_name = args.run_name or (f"{args.task}_{args.objective}{estimator}{options}_u{args.updates_per_batch}"
                                      f"{f'_pool{args.rl_pool}' if args.rl_pool else ''}_seed{args.seed}")
    return bgpo.check_args(p, args)

# -----------------------------------------------------------------------------
# The objective with the lab's options, and the update built in two parts

def split_by_sign(objective, stats):
    """objective, with its backward run twice: on the rows with A > 0, then on those with A < 0, each
    part's A scaled by its share of the rows (every objective is a mean over rows, so the two parts add
    up to the whole; rows with A = 0 contribute nothing). The parts' norms and cosine go into stats."""
    def backward(model, batch, state, A, args, inner):
        loss, grads = 0.0, []
        for rows in (A > 0, A < 0):
            n = int(rows.sum())
            if n:
                loss += objective.backward(model, rows_of(batch, rows), rows_of(state, rows), A[rows] * n / len(A), args, inner)
            grads.append(flat_grad(model))
        g_pos, g_neg = grads[0], grads[1] - grads[0]
        stats.update(grad_pos=g_pos.norm().item(), grad_neg=g_neg.norm().item(),
                     cos_pos_neg=torch.nn.functional.cosine_similarity(g_pos, g_neg, dim=0).item())
        return loss
    return dataclasses.replace(objective, backward=backward)

def lab_objective(args, stats):
    """--objective's Objective with the lab's sampler, advantages (d1's or Eq. 18's) and split update."""
    advantages = d1_advantages if args.d1_advantages else bgpo.group_advantages
    return split_by_sign(dataclasses.replace(OBJECTIVES[args.objective], sampler=lab_sampler, advantages=advantages), stats)

# -----------------------------------------------------------------------------
# The practice pool and the extra log fields

class Pool:
    """A task whose training problems are a fixed pool (--rl-pool); everything else is the task's."""

    def __init__(self, task, prompts):
        self.task, self.prompts = task, prompts

    def __getattr__(self, name):
        return getattr(self.task, name)

    def sample(self, n, split, generator):
        if split != "train":
            return self.task.sample(n, split, generator)
        return [self.prompts[i] for i in torch.randperm(len(self.prompts), generator=generator)[:n]], None

@torch.no_grad()
def prediction_entropy(model, prompts, gen_len):
    """Mean entropy (nats) of the model's prediction at each completion position with the whole
    completion masked, the sampler's first step: how sure the policy is before it writes anything."""
    masked = torch.full((prompts.shape[0], gen_len), model.config.mask_id, dtype=torch.long, device=prompts.device)
    logp = model(torch.cat([prompts, masked], 1))[:, prompts.shape[1]:].log_softmax(-1)
    return -(logp.exp() * logp.nan_to_num(0.0)).sum(-1).mean().item()  # MASK's -inf: 0 * -inf -> 0

def diagnostics(task, args, stats, pool=None):
    """bgpo.run_rl's on_step: the gradient split, entropy and sampler passes of each step, and the pool's accuracy."""
    def on_step(record, model, batch):
        text = []
        if batch is not None:
            record.update({"entropy": prediction_entropy(model, batch.x, task.gen_len), "grad_pos": 0.0, "grad_neg": 0.0,
                           "cos_pos_neg": 0.0, **stats, "rollout_passes": int(batch.commit_steps.max()) + 1})
            stats.clear()                                          # (the zeros stand when every group tied: no update)
            text.append(f"entropy {record['entropy']:.2f} | cos(g+, g-) {record['cos_pos_neg']:+.2f}")
        if pool and "accuracy" in record:
            record["pool_accuracy"] = evaluate(model, task, pool[:args.eval_size], args, n_show=0)["accuracy"]
            text.append(f"pool accuracy {record['pool_accuracy']:.1%}")
        return " | ".join(text) or None
    return on_step

def main(argv=None):
    args = parse_args(argv)
    task, stats = get_task(args.task), {}
    pool = task.sample(args.rl_pool, "train", args.seed + 2)[0] if args.rl_pool else None
    history = bgpo.run(args, lab_objective(args, stats), diagnostics(task, args, stats, pool), Pool(task, pool) if pool else None)
    if args.plot and args.stage != "sft":
        run_dir = os.path.join(args.out_dir, args.run_name)
        draw(curves_figure({args.run_name: read_log(os.path.join(run_dir, "log.jsonl"))}), os.path.join(run_dir, "curves.png"))
    return history

if __name__ == "__main__":
    bgpo.command_line(main, "python -m lab.rl")
