"""
The lab's RL loop: bgpo.run_rl's with the field's objectives and the lab's diagnostics:

    python -m lab.rl --objective NAME [any bgpo.py flag] [lab flags]

NAME: bgpo, naive, naive-two-pass, lemma1-only, lemma2-only, diffu-grpo, stp, dtrpo or trajectory.

run_rl below is bgpo.run_rl's loop with its five steps made replaceable, and it shares everything
else with bgpo.py: the rollouts (bgpo.sample_rollouts), the advantages (bgpo.group_advantages), the
run's folder, log, evaluations, checkpoints and resume (bgpo.RLLog), and the command line's flags.
With --objective bgpo or naive and no lab option it draws the same random numbers in the same order.
What it adds:
1. The field's objectives (lab/objectives.py), each an Objective (its per-batch draws and its update),
   with their own defaults: d1's and STP's mu = 4 inner updates, d1's clip 0.5, STP's num_t = 3
   (--mc-samples) and early stop 0.75 (--stp-tau).
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
import math
import os
import time

import torch

import bgpo
import lab
from bgpo import ActivationMemory, RLLog, evaluate, positive_float, positive_int, sample_rollouts
from lab.figures import curves_figure, draw, read_log
from lab.objectives import OBJECTIVES, d1_advantages, flat_grad, lab_sampler, rows_of
from tasks import get_task

FIELD = ("diffu-grpo", "stp", "dtrpo")  # d1, STP and dTRPO: mu = 4 inner updates by default
ELBO = ("bgpo", "naive", "naive-two-pass", "lemma1-only", "lemma2-only")  # n_t masked copies of the ELBO

def make_parser():
    p = lab.make_parser("python -m lab.rl",
                        "bgpo.py's SFT and RL with the field's objectives and the lab's diagnostics.")
    a = p.add_argument
    a("--objective", choices=list(OBJECTIVES), default="bgpo",
      help="BGPO, the naive objective, one of the field's methods (lab/objectives.py), "
           "or the trajectory control")
    a("--mc-samples", type=positive_int, default=None,
      help="MC samples n_t per completion, for bgpo, naive and stp (default: 16; STP's num_t: 3)")
    a("--updates-per-batch", type=positive_int, default=None,
      help="optimizer steps per rollout batch (mu); 1 = on-policy (default: 1; 4 for diffu-grpo, stp, dtrpo)")
    a("--clip-eps", type=positive_float, default=None,
      help="PPO clip, used when --updates-per-batch > 1 (default: 0.2; d1's 0.5 for diffu-grpo)")
    a("--stp-tau", type=float, default=None,
      help="STP's early stop: fill the rest in one pass once this fraction of tokens is in place "
           "(default: 0.75 with --objective stp)")
    a("--no-anchors", action="store_true",
      help="STP without its spatial pruning (no anchors), for the ablation")
    a("--d1-advantages", action="store_true",
      help="diffu-grpo with d1's advantage, reward minus group mean (default: z-scored, Eq. 18)")
    a("--remasking", choices=["low_confidence", "random"], default="low_confidence",
      help="which positions a rollout step commits: the most confident, or uniformly random ones")
    a("--rl-pool", type=bgpo.non_negative_int, default=0,
      help="practise on a fixed pool of N training problems; 0 = fresh problems every step")
    a("--plot", action="store_true",
      help="draw the run's curves as curves.png in its folder, if matplotlib is installed")
    a("--run-name", default=None,
      help="RL run folder in --out-dir "
           "(default: task_objective[_ntM][_tauT][_noanchors][_d1adv][_random]_uU[_kK][_poolN]_seedS)")
    return p

def parse_args(argv=None):
    p = make_parser()
    args = p.parse_args(argv)
    for flag, given, objective in (("--stp-tau", args.stp_tau is not None, "stp"),
                                   ("--no-anchors", args.no_anchors, "stp"),
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
    if args.objective == "trajectory" and (args.updates_per_batch > 1 or args.minibatches > 1):
        p.error("--objective trajectory is on-policy: use it with --updates-per-batch 1 and --minibatches 1")
    if 0 < args.rl_pool < args.prompts_per_step:
        p.error(f"--rl-pool {args.rl_pool} is smaller than --prompts-per-step {args.prompts_per_step}")
    # the others draw no masked copies
    estimator = f"_nt{args.mc_samples}" if args.objective in ELBO + ("stp",) else ""
    options = (f"_tau{args.stp_tau}" if args.stp_tau else "") + ("_noanchors" if args.no_anchors else "") + \
        ("_d1adv" if args.d1_advantages else "") + ("_random" if args.remasking == "random" else "")
    args.run_name = args.run_name or (f"{args.task}_{args.objective}{estimator}{options}"
                                      f"_u{args.updates_per_batch}"
                                      f"{f'_k{args.minibatches}' if args.minibatches > 1 else ''}"
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
                part_A = A[rows] * n / len(A)
                loss += objective.backward(model, rows_of(batch, rows), rows_of(state, rows), part_A,
                                           args, inner)
            grads.append(flat_grad(model))
        g_pos, g_neg = grads[0], grads[1] - grads[0]
        stats.update(grad_pos=g_pos.norm().item(), grad_neg=g_neg.norm().item(),
                     cos_pos_neg=torch.nn.functional.cosine_similarity(g_pos, g_neg, dim=0).item())
        return loss
    return dataclasses.replace(objective, backward=backward)

# -----------------------------------------------------------------------------
# The loop

def run_rl(args, task, model, pool=None):
    """bgpo.run_rl with --objective's draws and update, the lab's sampler and advantages, and diagnostics.
    pool: the fixed training problems of --rl-pool, or None for fresh ones."""
    stats, G = {}, args.group_size
    objective = split_by_sign(OBJECTIVES[args.objective], stats)
    advantages = d1_advantages if args.d1_advantages else bgpo.group_advantages
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    log = PoolLog(args, task, model, optimizer, generator, pool)
    for step in range(log.start, args.rl_steps + 1):
        t0 = time.time()
        if pool:
            order = torch.randperm(len(pool), generator=generator)
            prompts = [pool[i] for i in order[:args.prompts_per_step]]
        else:
            prompts = task.sample(args.prompts_per_step, "train", generator)[0]
        batch = sample_rollouts(model, task, prompts, G, args, generator, lab_sampler(task, prompts, args))
        A = advantages(batch.rewards, G).to(args.device)                                 # (B,)
        A = torch.where(A < 0, args.neg_weight * A, A)
        state = objective.prepare(model, batch, args, generator)
        for group in optimizer.param_groups:
            group["lr"] = args.rl_lr * (min(1.0, step / args.rl_warmup) if args.rl_warmup else 1.0)
        minibatch = torch.arange(len(A), device=A.device) * args.minibatches // len(A)     # (B,) 0..K-1
        losses = []
        with ActivationMemory(model) as memory:
            for inner in range(args.updates_per_batch):
                for k in range(args.minibatches):
                    rows = minibatch == k
                    optimizer.zero_grad(set_to_none=True)
                    if not A[rows].any():
                        continue
                    losses.append(objective.backward(model, rows_of(batch, rows), rows_of(state, rows),
                                                     A[rows], args, inner))
                    if not math.isfinite(losses[-1]):
                        raise log.diverged(step, losses[-1])
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
        loss = sum(losses) / len(losses) if losses else 0.0
        fields = {"entropy": prediction_entropy(model, batch.x, task.gen_len),
                  "grad_pos": 0.0, "grad_neg": 0.0, "cos_pos_neg": 0.0, **stats,
                  "rollout_passes": int(batch.commit_steps.max()) + 1}
        stats.clear()  # (the zeros stand when every group tied: no update)
        text = f"entropy {fields['entropy']:.2f} | cos(g+, g-) {fields['cos_pos_neg']:+.2f}"
        log.step(step, batch, loss, memory.peak, time.time() - t0, fields, text)
    return log.history

class PoolLog(RLLog):
    """bgpo.RLLog, with the accuracy on the practice pool at each evaluation (--rl-pool)."""

    def __init__(self, args, task, model, optimizer, generator, pool):
        self.pool = pool
        super().__init__(args, task, model, optimizer, generator)

    def evaluate(self, record):
        text = super().evaluate(record)
        if not self.pool:
            return text
        record["pool_accuracy"] = evaluate(self.model, self.task, self.pool[:self.args.eval_size], self.args,
                                           n_show=0)["accuracy"]
        return text + f" | pool accuracy {record['pool_accuracy']:.1%}"

@torch.no_grad()
def prediction_entropy(model, prompts, gen_len):
    """Mean entropy (nats) of the model's prediction at each completion position with the whole
    completion masked, the sampler's first step: how sure the policy is before it writes anything."""
    masked = torch.full((prompts.shape[0], gen_len), model.config.mask_id,
                        dtype=torch.long, device=prompts.device)
    logp = model(torch.cat([prompts, masked], 1))[:, prompts.shape[1]:].log_softmax(-1)
    return -(logp.exp() * logp.nan_to_num(0.0)).sum(-1).mean().item()  # MASK's -inf: 0 * -inf -> 0

def main(argv=None):
    args = parse_args(argv)
    pool = get_task(args.task).sample(args.rl_pool, "train", args.seed + 2)[0] if args.rl_pool else None
    history = bgpo.run(args, lambda args, task, model: run_rl(args, task, model, pool))
    if args.plot and args.stage != "sft":
        run_dir = os.path.join(args.out_dir, args.run_name)
        figure = curves_figure({args.run_name: read_log(os.path.join(run_dir, "log.jsonl"))})
        draw(figure, os.path.join(run_dir, "curves.png"))
    return history

if __name__ == "__main__":
    bgpo.command_line(main, "python -m lab.rl")
