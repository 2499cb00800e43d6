"""
The lab's RL loop: bgpo.py's SFT, then a copy of bgpo.run_rl with the field's objectives, the lab's
sampler and options, and its diagnostics:

    python -m lab.rl --objective NAME [any bgpo.py flag] [lab flags]

NAME: bgpo, naive, naive-two-pass, lemma1-only, lemma2-only, diffu-grpo, stp, dtrpo, spg or trajectory.

run_rl below copies bgpo.run_rl: the same five steps in the same order, the same log.jsonl, progress
evaluations, checkpoints (at every --eval-every) and resume. SFT is bgpo.py's (bgpo.sft_model). With
--objective bgpo or naive and no lab option it draws the same random numbers in the same order, and sees
the same rollouts as bgpo.py at every step (a test checks it). What it adds:
1. The field's objectives (lab/objectives.py), each an Objective (its per-batch draws and its update),
   with their own defaults: d1's and STP's mu = 4 inner updates, d1's clip 0.5, STP's num_t = 3
   (--mc-samples) and early stop 0.75 (--stp-tau).
2. Options: the lab's flags (lab/cli.py: --temperature, --neg-weight, --rl-lr, --rl-warmup, --clip-eps,
   --updates-per-batch, --gen-steps, --block-len), --remasking random (rollouts whose exact policy
   gradient is known), --advantages (Eq. 18's z-score; d1's reward minus the group mean; or rejection-
   sampling fine-tuning's 1 for a solved rollout and 0 otherwise), --reward solved (the task's reward
   without its 0.1 for a well-formed wrong answer), --no-anchors, --rl-pool N (practise on a fixed pool of
   N training problems and report the accuracy on them beside the progress one), --final-eval-size N (the
   SFT model and the final one on N test problems, greedy accuracy and entropy, in final.json: the
   sweep's tables read it) with --pass-at-k-size N (pass@k at the rollout temperature on the first N of
   them), --sft-stop N (RL from step N of the same SFT run instead of the model SFT keeps), for BGPO
   two levers that spend the policy's entropy slower: --cov-detach F and --entropy-coef C, and two levers for
   RL past the SFT model's reach (lab/levers.py): --dynamic-batches N (DAPO's dynamic sampling) and --hints
   (IGPO's inpainted rollouts for the groups that all fail, or the known solution itself as their control).
3. Diagnostics in log.jsonl: for an objective that is a mean over rows (Objective.row_mean), the update is
   built in two parts, the rows with A > 0 and those with A < 0 (each part's A scaled by its share of the
   rows, so they add up to the same step), logged as grad_pos, grad_neg and their cosine cos_pos_neg; the
   groups that differ by a solve (solve_groups) or by partial credit only (credit_only_groups); the
   policy's first-step prediction entropy; the sampler's forward passes per rollout (rollout_passes) and
   the rollouts' seconds; the share of well-formed answers (valid); of every group the sampler drew, the
   share never solved and always solved (never_solved, always_solved); the share of the update's rows with
   A != 0 (informative_rows); the sampler batches drawn (sampler_batches) and the groups hinted.
   Splitting the update changes the float summation order, so a run here differs from bgpo.py's by
   rounding, not by what it computes.
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch

import bgpo
from bgpo import RunError, test_problems, load_checkpoint, save_checkpoint
from lab import cli
from lab.figures import curves_figure, draw, read_log
from lab.objectives import ADVANTAGES, OBJECTIVES, SPG_BETA, SPG_MIX, flat_grad, rows_of, sampler_options
from lab.estimators import random_order_log_likelihood
from lab.levers import PROBE_POOL, dynamic_rollouts, hinted_rollouts, probed_rollouts
from lab.sampler import evaluate, sample_rollouts
from tasks import MAX_TEXT, ParseError, encode, get_task, parse_expression
from tiny_dllm import ActivationMemory, sft_loss

FIELD = ("diffu-grpo", "stp", "dtrpo")  # d1, STP and dTRPO: mu = 4 inner updates by default
ELBO = ("bgpo", "naive", "naive-two-pass", "lemma1-only", "lemma2-only", "spg")  # n_t masked copies
MC_SAMPLES = bgpo.make_parser().get_default("mc_samples")                  # bgpo.py's n_t
PASS_SAMPLES, PASS_K = 32, (1, 2, 4, 8, 16, 32)   # samples per problem for pass@k, and the k reported

def make_parser():
    p = cli.make_parser("python -m lab.rl",
                        "bgpo.py's SFT and RL with the field's objectives and the lab's diagnostics.")
    a = p.add_argument
    a("--objective", choices=list(OBJECTIVES), default="bgpo",
      help="BGPO, the naive objective, one of the field's methods (lab/objectives.py), "
           "or the trajectory control")
    a("--mc-samples", type=int, default=None,
      help=f"MC samples n_t per completion, for bgpo, naive and stp (None: {MC_SAMPLES}; STP's num_t: 3)")
    a("--updates-per-batch", type=int, default=None,
      help="optimizer steps per rollout batch (mu); 1: on-policy (None: 1; 4 for diffu-grpo, stp, dtrpo)")
    a("--clip-eps", type=float, default=None,
      help=f"PPO clip, used when off-policy (None: {bgpo.CLIP_EPS}; d1's 0.5 for diffu-grpo)")
    a("--stp-tau", type=float, default=None,
      help="STP's early stop: fill the rest in one pass once this fraction of tokens is in place "
           "(None: 0.75 with --objective stp)")
    a("--no-anchors", action="store_true", help="STP without its spatial pruning (anchors), for the ablation")
    a("--spg-beta", type=float, default=None,
      help=f"SPG's beta, the upper bound's exponent (None: {SPG_BETA}, its public code's for Countdown)")
    a("--spg-mix", type=float, default=None,
      help=f"SPG's weight omega of the upper bound where A < 0, the ELBO's 1 - omega (None: {SPG_MIX}); "
           "1: the upper bound alone")
    a("--cov-detach", type=float, default=0.0,
      help="BGPO: in each masked copy, this fraction of its masked positions with the largest covariance of "
           "log p and A lose their gradient (Clip-Cov-like); negative: the smallest; 0: off")
    a("--entropy-coef", type=float, default=0.0,
      help="BGPO: a bonus of this weight for the entropy of its predictions at masked positions; 0: off")
    a("--advantages", choices=list(ADVANTAGES), default="group",
      help="group: Eq. 18's z-score; no-std: the reward minus the group mean (d1's); rft: 1 for a solved "
           "rollout, 0 otherwise (rejection-sampling fine-tuning); w-reinforce: +0.1 for a solved "
           "rollout, -1 otherwise (Zhu et al.)")
    a("--reward", choices=["task", "solved"], default="task",
      help="what the advantages read: the task's reward, or 1 for a solved problem and 0 otherwise")
    a("--final-eval-size", type=int, default=0,
      help="test problems on which the SFT model and the final one are scored into final.json; 0: none")
    a("--pass-at-k-size", type=int, default=0,
      help=f"of those, the first N also get pass@k (k up to {PASS_SAMPLES}) from {PASS_SAMPLES} samples each "
           "at --temperature, in final.json; 0: none")
    a("--remasking", choices=["low_confidence", "random"], default="low_confidence",
      help="which positions a rollout step commits: the most confident, or uniformly random ones")
    a("--rl-pool", type=int, default=0, help="practise on a fixed pool of N training problems; 0: fresh ones")
    a("--dynamic-batches", type=int, default=1,
      help="DAPO's dynamic sampling: keep only the groups whose rewards differ, drawing fresh prompts again "
           "until --prompts-per-step are kept or this many sampler batches were drawn; 1: off "
           "(lab/levers.py)")
    a("--hints", choices=["none", "inpaint", "solution"], default="none",
      help="for a group whose rollouts all fail, IGPO's inpainted rollout (part of a known solution fixed, "
           "kept if it solves) or the known solution itself, in place of its last rollout (lab/levers.py)")
    a("--hint-decay", action="store_true",
      help="with --hints inpaint: the hinted share of the solution falls linearly over the run, to one token")
    a("--probe", type=int, default=0,
      help="selective rollouts: K rollouts of twice the prompts first, the prompts whose K differ kept "
           "first, then each kept group completed to G (lab/levers.py); 0: off")
    a("--rollout-order", choices=["confidence", "left-to-right"], default="confidence",
      help="the rollouts' sampler: the most confident tokens first, or one token a step from the left "
           "(JustGRPO's order); the greedy evaluations stay confidence-first")
    a("--sft-stop", type=int, default=0,
      help="stop SFT at this step and start RL from that step's model (the same SFT run, trained less); "
           "0: bgpo.py's SFT, which keeps its best validated model")
    a("--track-answers", type=int, default=0,
      help="log at every evaluation the exact likelihood of the SFT model's G answers to the first N "
           "test problems, wrong and right apart (2^L forward rows per answer); 0: none")
    a("--plot", action="store_true", help="draw the run's curves as curves.png in its folder (matplotlib)")
    a("--run-name", default=None,
      help="RL run folder in --out-dir "
           "(None: task_objective[_ntM][_tauT][_noanchors][_ADV][_solved][_random][_dynN][_hints-H][_decay]"
           "[_uU][_mbK][_poolN]_seedS"
           "[_HASH], HASH: of every other flag that differs from its default)")
    return p

def parse_args(argv=None):
    p = make_parser()
    args = p.parse_args(argv)
    # before the objective's own defaults are filled in: a flag given at its default is not a change
    settings = cli.settings_hash(p, argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                           if k not in cli.NOT_RESULTS}))
    for flag, given, objective in (("--stp-tau", args.stp_tau is not None, "stp"),
                                   ("--no-anchors", args.no_anchors, "stp"),
                                   ("--spg-beta", args.spg_beta is not None, "spg"),
                                   ("--spg-mix", args.spg_mix is not None, "spg")):
        if given and args.objective != objective:
            p.error(f"{flag} is an option of --objective {objective}, not {args.objective}")
    for flag, value in (("--cov-detach", args.cov_detach), ("--entropy-coef", args.entropy_coef)):
        if value and args.objective != "bgpo":
            p.error(f"{flag} is an option of --objective bgpo, not {args.objective}")
        if value and args.mc_chunk != 1:
            p.error(f"{flag} runs one masked copy per backward: use it with --mc-chunk 1")
    if not -1 < args.cov_detach < 1:
        p.error(f"--cov-detach must be in (-1, 1), got {args.cov_detach}")
    if not args.entropy_coef >= 0:
        p.error(f"--entropy-coef must be >= 0, got {args.entropy_coef}")
    if args.stp_tau is not None and not 0 < args.stp_tau <= 1:
        p.error(f"--stp-tau must be in (0, 1], got {args.stp_tau}")
    if args.spg_beta is not None and not args.spg_beta > 0:
        p.error(f"--spg-beta must be positive, got {args.spg_beta}")
    if args.spg_mix is not None and not 0 <= args.spg_mix <= 1:
        p.error(f"--spg-mix must be in [0, 1], got {args.spg_mix}")
    for flag, value in (("--rl-pool", args.rl_pool), ("--final-eval-size", args.final_eval_size),
                        ("--track-answers", args.track_answers),
                        ("--pass-at-k-size", args.pass_at_k_size), ("--sft-stop", args.sft_stop)):
        if value < 0:
            p.error(f"{flag} must be an integer >= 0, got {value}")
    if args.pass_at_k_size > args.final_eval_size:
        p.error(f"--pass-at-k-size {args.pass_at_k_size} is more than --final-eval-size "
                f"{args.final_eval_size}: pass@k is scored on the first problems of the final evaluation")
    stp = args.objective == "stp"
    for name, default in (("stp_tau", 0.75 if stp else None), ("mc_samples", 3 if stp else MC_SAMPLES),
                          ("updates_per_batch", 4 if args.objective in FIELD else 1),
                          ("clip_eps", 0.5 if args.objective == "diffu-grpo" else bgpo.CLIP_EPS),
                          ("spg_beta", SPG_BETA), ("spg_mix", SPG_MIX)):
        if getattr(args, name) is None:  # the objective's own default
            setattr(args, name, default)
    args.anchors = stp and not args.no_anchors and args.task == "sudoku"   # the other tasks have no anchors
    if args.objective in ("trajectory", "spg") and (args.updates_per_batch > 1 or args.minibatches > 1):
        p.error(f"--objective {args.objective} is on-policy here: use it with --updates-per-batch 1 and "
                "--minibatches 1")
    if args.sft_stop > args.sft_steps:
        p.error(f"--sft-stop {args.sft_stop} is past --sft-steps {args.sft_steps}")
    if args.dynamic_batches < 1:
        p.error(f"--dynamic-batches must be an integer >= 1, got {args.dynamic_batches}")
    if args.hint_decay and args.hints != "inpaint":
        p.error("--hint-decay lowers the share of an inpainted hint: use it with --hints inpaint")
    if args.probe and (not 1 <= args.probe < args.group_size or args.dynamic_batches > 1 or args.rl_pool):
        p.error(f"--probe must be in 1..{args.group_size - 1} (--group-size - 1), without --dynamic-batches "
                f"or --rl-pool, got {args.probe}")
    if args.rl_pool and (args.dynamic_batches > 1 or args.hints != "none"):
        p.error("--dynamic-batches and --hints draw fresh problems with their solutions: not with --rl-pool")
    if 0 < args.rl_pool < args.prompts_per_step:
        p.error(f"--rl-pool {args.rl_pool} is smaller than --prompts-per-step {args.prompts_per_step}")
    # bgpo.py's run name, with the lab's options; the others draw no masked copies
    estimator = f"_nt{args.mc_samples}" if args.objective in ELBO + ("stp",) else ""
    options = (f"_tau{args.stp_tau}" if args.stp_tau else "") + ("_noanchors" if args.no_anchors else "") + \
        (f"_{args.advantages}" if args.advantages != "group" else "") + \
        ("_solved" if args.reward == "solved" else "") + ("_random" if args.remasking == "random" else "") + \
        (f"_dyn{args.dynamic_batches}" if args.dynamic_batches > 1 else "") + \
        (f"_hints-{args.hints}" if args.hints != "none" else "") + ("_decay" if args.hint_decay else "")
    args.run_name = args.run_name or (f"{args.task}_{args.objective}{estimator}{options}"
                                      f"{f'_u{args.updates_per_batch}' if args.updates_per_batch > 1 else ''}"
                                      f"{f'_mb{args.minibatches}' if args.minibatches > 1 else ''}"
                                      f"{f'_pool{args.rl_pool}' if args.rl_pool else ''}_seed{args.seed}"
                                      + settings)
    return cli.check_args(p, args)

def valid(task, prompt, completion):
    """Whether a completion is a well-formed answer, right or wrong: the RL log tracks that share, because
    a policy that collapses stops writing valid answers before its reward says why. The three rules that
    tasks.py's Task.valid had: arithmetic, a number (digits only); Countdown, an expression that uses
    exactly the prompt's numbers, whatever its value; Sudoku, 16 digits in 1-4 that keep the prompt's
    given cells. The answer is read as the rewards read it: up to the first '$' (EOS), MAX_TEXT at most."""
    answer = completion[:MAX_TEXT].split("$")[0] if isinstance(completion, str) else ""
    if task.name == "arithmetic":
        return answer.isdigit()
    if task.name == "countdown":
        try:
            numbers_text, target_text = prompt.split(":")
            numbers, _ = sorted(int(s) for s in numbers_text.split(",")), int(target_text)
            return sorted(parse_expression(answer)[1]) == numbers
        except (ValueError, AttributeError, ParseError):
            return False
    if task.name == "sudoku":
        answer, cells = answer[:16], prompt.replace("|", "") if isinstance(prompt, str) else ""
        return (len(answer) == 16 == len(cells) and set(answer) <= set("1234")
                and all(c in (".", a) for c, a in zip(cells, answer)))
    raise ValueError(f"task: no rule for {task.name!r}")

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

def advantages(rewards, args):
    """--advantages of the rewards of consecutive groups of --group-size, the negative ones weighted by
    --neg-weight: (B,), on --device."""
    A = ADVANTAGES[args.advantages](rewards, args.group_size).to(args.device)
    return torch.where(A < 0, args.neg_weight * A, A)

def tracked_answers(model, task, args, n_prompts):
    """G rollouts of each of the first n_prompts progress problems from the SFT model, drawn from a stream of
    their own: the answers whose exact likelihoods --track-answers logs and lab.negatives --track measures."""
    return sample_rollouts(model, task, test_problems(task, args)[:n_prompts], args.group_size, args,
                           torch.Generator().manual_seed(args.seed + 6))

def track_likelihoods(model, tracked, record):
    """Adds to a log record the exact log pi and ELBO per token (lab/estimators.py, in the model's dtype) of
    the tracked answers, mean over the wrong ones and over the right ones: track_{wrong,right}_{log_pi,elbo}
    (None where there is none)."""
    elbo, log_pi = (torch.stack(v) for v in zip(*(random_order_log_likelihood(model, x, y)
                                                   for x, y in zip(tracked.x, tracked.y))))
    right, L = (tracked.rewards == 1.0).to(elbo.device), tracked.y.shape[1]
    for kind, rows in (("wrong", ~right), ("right", right)):
        for name, value in (("log_pi", log_pi), ("elbo", elbo)):
            record[f"track_{kind}_{name}"] = value[rows].mean().item() / L if rows.any() else None

def progress_eval(model, task, args, record, pool=None, tracked=None):
    """A copy of bgpo.score_test_problems (with the lab's sampler flags), the policy's entropy on the progress
    prompts (policy_entropy), the accuracy on the --rl-pool problems and the tracked answers' likelihoods
    (track_likelihoods): adds them to a step's log record; returns the line to print, with three examples."""
    prompts = test_problems(task, args)
    result = evaluate(model, task, prompts, args)
    record.update(accuracy=result["accuracy"], eval_reward=result["reward"],
                  eval_entropy=policy_entropy(model, task, prompts, args))
    text = (f"progress accuracy {result['accuracy']:.1%} (reward {result['reward']:.3f}, "
            f"entropy {record['eval_entropy']:.3f})")
    if pool:
        record["pool_accuracy"] = evaluate(model, task, pool[:args.eval_size], args, n_show=0)["accuracy"]
        text += f" | pool accuracy {record['pool_accuracy']:.1%}"
    if tracked is not None:
        with torch.no_grad():
            track_likelihoods(model, tracked, record)
        wrong = record["track_wrong_log_pi"]
        text += " | tracked wrong answers: " + ("none" if wrong is None else f"log pi {wrong:+.3f} per token")
    return text + "\n" + "\n".join(result["examples"])

def run_rl(args, task, model, pool=None, tracked=None):
    """A copy of bgpo.run_rl with --objective's draws and update, the lab's sampler, advantages and
    options, and its diagnostics. pool: the fixed training problems of --rl-pool, or None for fresh ones;
    tracked: the answers of --track-answers (tracked_answers), or None.
    Returns the records with a progress evaluation (step 0 is the SFT model)."""
    stats, G, B = {}, args.group_size, args.prompts_per_step * args.group_size
    objective = OBJECTIVES[args.objective]
    if objective.row_mean:   # the update in two parts, for the diagnostics; else one backward on the batch
        objective = split_by_sign(objective, stats)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    run_dir = os.path.join(args.out_dir, args.run_name)
    ckpt_path, log_path = os.path.join(run_dir, "ckpt.pt"), os.path.join(run_dir, "log.jsonl")
    if args.resume:
        state = load_checkpoint(ckpt_path, task, model.config)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["rng"][0])   # bgpo.py saves one stream per process; the lab runs one
        start, records = state["step"] + 1, [json.loads(line) for line in open(log_path)]
        records = [r for r in records if r["step"] < start]  # the log matches the checkpoint
        print(f"resumed {ckpt_path} at step {state['step']}")
    else:
        bgpo.show_unmasking(model, task, test_problems(task, args)[0], args)
        start, records = 1, [{"step": 0}]
        print("RL step 0 (SFT model): " + progress_eval(model, task, args, records[0], pool, tracked))
    os.makedirs(run_dir, exist_ok=True)
    if not args.resume:
        cli.write_json(os.path.join(run_dir, "run.json"), cli.describe_run(args))
    with open(log_path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(log_path + ".tmp", log_path)
    saved = start - 1
    rollout_args = argparse.Namespace(**{**vars(args), "block_len": 1, "gen_steps": None}) \
        if args.rollout_order == "left-to-right" else args   # the rollouts' sampler; evaluations keep args
    for step in range(start, args.rl_steps + 1):
        t0 = time.time()
        # 1. training problems, fresh or from the pool, and G completions of each with the lab's sampler;
        # with --dynamic-batches, only groups whose rewards differ; with --hints, a solve in all-fail groups
        # (with both, inside each draw: a hinted group is then a mixed one, kept)
        scale = 1 - (step - 1) / args.rl_steps if args.hint_decay else 1.0
        own, hinted = [], []   # every drawn batch's rewards before its hints; the groups given a hinted solve
        hint_seconds = [0.0]   # of the rollouts' seconds, the hinted rollouts'
        probe_mixed, rows_sampled = [None], [1.0]   # --probe: kept prompts whose probes differed; rows

        def hint(batch, answers):
            t_hint = time.time()
            options = sampler_options(task, batch.prompts[::G], args)
            batch, got, _ = hinted_rollouts(model, task, batch, answers, G, rollout_args, generator,
                                            args.hints, scale, **options)
            hinted.append(got)
            hint_seconds[0] += time.time() - t_hint
            return batch

        def sample(prompts, k):   # k rollouts of each prompt, in the rollouts' order
            options = sampler_options(task, prompts, argparse.Namespace(**{**vars(args), "group_size": k}))
            return sample_rollouts(model, task, prompts, k, rollout_args, generator, **options)

        def draw():
            if pool:
                order = torch.randperm(len(pool), generator=generator)
                prompts, answers = [pool[i] for i in order[:args.prompts_per_step]], None
            else:
                prompts, answers = task.sample(args.prompts_per_step * (PROBE_POOL if args.probe else 1),
                                               "train", generator)
            if args.probe:   # selective rollouts: the prompts whose probes differ first
                batch, answers, probe_mixed[0], rows_sampled[0] = probed_rollouts(
                    sample, prompts, answers, G, args.prompts_per_step, args.probe)
            else:
                batch = sample(prompts, G)
            own.append(batch.rewards)
            hint_now = args.hints != "none" and args.dynamic_batches > 1
            return (hint(batch, answers) if hint_now else batch), answers
        if args.dynamic_batches > 1:
            batch, answers, _, batches = dynamic_rollouts(draw, args.prompts_per_step, G,
                                                          args.dynamic_batches)
        else:
            (batch, answers), batches = draw(), 1
        if args.hints != "none" and args.dynamic_batches == 1:
            batch = hint(batch, answers)
        drawn = torch.stack(own)                                    # (batches, prompts x G), the policy's own
        hinted = torch.cat(hinted) if hinted else torch.zeros(len(batch.prompts) // G, dtype=torch.bool)
        B = len(batch.prompts)
        rollout_seconds = time.time() - t0
        # 2. the verifier's rewards (batch.rewards) -> 3. advantages (Eq. 18, or d1's)
        scored = (batch.rewards == 1.0).to(batch.rewards) if args.reward == "solved" else batch.rewards
        A = advantages(scored, args)                                                 # (B,)
        # 4. the objective's draws, fixed for the batch (BGPO's: n_t masked copies, and old_terms off-policy)
        state = objective.prepare(model, batch, args, generator)
        # 5. the updates: --updates-per-batch passes, each one update per mini-batch of whole groups
        for group in optimizer.param_groups:
            group["lr"] = args.rl_lr * (min(1.0, step / args.rl_warmup) if args.rl_warmup else 1.0)
        minibatch = torch.arange(B, device=A.device) * args.minibatches // B               # (B,) 0..K-1
        losses, t_update = [], time.time()
        with ActivationMemory(model) as memory:
            for inner in range(args.updates_per_batch):
                for k in range(args.minibatches):
                    rows = minibatch == k
                    if not A[rows].any():  # every group tied: no signal; an Adam step would move the weights
                        continue
                    optimizer.zero_grad(set_to_none=True)
                    loss = objective.backward(model, rows_of(batch, rows), rows_of(state, rows), A[rows],
                                              args, inner)
                    if not math.isfinite(loss):  # stop before the step: the last checkpoint stays good
                        raise RunError(f"loss is {loss} at RL step {step}; stopped. Last good checkpoint: "
                                       + (f"{ckpt_path} (step {saved})" if saved else "none yet"))
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    losses.append(loss)
        update_seconds = time.time() - t_update
        rewards, groups = batch.rewards, batch.rewards.view(-1, G)
        solved, unsolved = (groups == 1).any(1), (groups < 1).all(1)    # (B / G,): with a solve, without
        mixed = groups.amax(1) > groups.amin(1)
        drawn_groups = drawn.view(-1, G)                   # every group the sampler drew, before the hints
        records.append(r := {"step": step, "reward": rewards.mean().item(),
                             "reward_std": rewards.std().item(),
                             "mixed_groups": mixed.double().mean().item(),
                             # the groups whose signal is a solve; those that differ by partial credit only
                             "solve_groups": (solved & mixed).double().mean().item(),
                             "credit_only_groups": (unsolved & mixed).double().mean().item(),
                             # per prompt over its group, of every group drawn: never solved, always solved
                             "never_solved": (drawn_groups < 1).all(1).double().mean().item(),
                             "always_solved": (drawn_groups == 1).all(1).double().mean().item(),
                             "informative_rows": (A != 0).double().mean().item(),
                             "sampler_batches": batches if not args.probe else rows_sampled[0],
                             "probe_mixed": probe_mixed[0], "hinted_groups": hinted.double().mean().item(),
                             "solved": (rewards == 1.0).double().mean().item(),
                             "valid": sum(map(valid, [task] * B, batch.prompts, batch.texts)) / B,
                             "loss": sum(losses) / len(losses) if losses else 0.0,
                             "activation_mb": memory.peak / 2**20,
                             "entropy": prediction_entropy(model, batch.x, task.gen_len),
                             "grad_pos": 0.0, "grad_neg": 0.0, "cos_pos_neg": 0.0, **stats,  # 0: no step
                             "rollout_passes": int(batch.commit_steps.max()) + 1,
                             "rollout_seconds": rollout_seconds, "hint_seconds": hint_seconds[0],
                             "update_seconds": update_seconds, "seconds": time.time() - t0})
        stats.clear()
        line = (f"RL step {step:4d} | reward {r['reward']:.3f} ± {r['reward_std']:.3f} | mixed groups "
                f"{r['mixed_groups']:4.0%} | solved {r['solved']:5.1%} | act {r['activation_mb']:.1f} MiB | "
                f"{r['seconds']:.2f} s | entropy {r['entropy']:.2f} | cos(g+, g-) {r['cos_pos_neg']:+.2f}")
        if step % args.eval_every == 0 or step == args.rl_steps:
            line += " | " + progress_eval(model, task, args, r, pool, tracked)
        print(line)
        if "accuracy" in r and not any(q.get("solve_groups", 1) for q in records[-args.eval_every:]):
            dead = sum(not q.get("solve_groups", 1) for q in records[1:])
            why = ("the rollouts solve nearly every problem: little left to learn" if r["solved"] >= .5 else
                   "the policy solves too few problems: more SFT (--sft-steps, --demos) or another --seed")
            print(f"warning: {dead} of {step} RL steps had no solve group (a solve and a miss): {why}")
        with open(log_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        if "accuracy" in r:  # saved after the log line, so that a resume from it finds the line
            save_checkpoint(ckpt_path, task, model.config, stage="rl", step=step, model=model.state_dict(),
                            optimizer=optimizer.state_dict(), rng=[generator.get_state()])
            saved = step
    return [r for r in records if "accuracy" in r]

@torch.no_grad()
def first_step_logits(model, prompts, gen_len):
    """The model's logits at every completion position with the whole completion masked (the sampler's
    first step): (N, L, V)."""
    masked = torch.full((prompts.shape[0], gen_len), model.config.mask_id,
                        dtype=torch.long, device=prompts.device)
    return model(torch.cat([prompts, masked], 1))[:, prompts.shape[1]:]

def entropy(logits):
    """Entropy (nats) of softmax(logits) at each position: (...,)."""
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp.nan_to_num(0.0)).sum(-1)  # MASK's -inf: 0 * -inf -> 0

def prediction_entropy(model, prompts, gen_len):
    """Mean entropy (nats) of the model's prediction at each completion position with the whole
    completion masked, the sampler's first step: how sure the policy is before it writes anything."""
    return entropy(first_step_logits(model, prompts, gen_len)).mean().item()

def policy_entropy(model, task, prompts, args, batch_size=256):
    """prediction_entropy, the quantity the training log's "entropy" is on the rollout prompts, averaged over
    problems' prompt strings: it is logged at every evaluation, so that a policy that narrows shows it."""
    values = [prediction_entropy(model, encode(task, prompts[i:i + batch_size], device=args.device),
                                 task.gen_len) * len(prompts[i:i + batch_size])
              for i in range(0, len(prompts), batch_size)]
    return sum(values) / len(prompts)

# -----------------------------------------------------------------------------
# The final evaluation: greedy accuracy, and how much the sampler can reach in k tries

def pass_at_k(n, c, k):
    """The unbiased estimate of pass@k, the chance that at least one of k samples solves the problem, from
    n >= k samples of which c solve it: 1 - C(n - c, k) / C(n, k), the chance that k of the n drawn
    without replacement hold a solve (Chen et al., arXiv 2107.03374, Eq. 1)."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int) and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need integers 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)

def solve_counts(model, task, prompts, n_samples, args, generator, per_call=16, **options):
    """Per prompt, how many of n_samples samples by lab.sampler.sample_rollouts (at --temperature, with
    generate's options: low-confidence remasking unless remasking= says otherwise) solve it."""
    solves = []
    for i in range(0, len(prompts), per_call):
        batch = sample_rollouts(model, task, prompts[i:i + per_call], n_samples, args, generator, **options)
        solves += (batch.rewards == 1.0).view(-1, n_samples).sum(1).tolist()
    return solves

def reach(model, task, prompts, args, generator, per_call=16):
    """pass@k for k in PASS_K at the rollout temperature, from PASS_SAMPLES samples of each prompt by
    lab.sampler.sample_rollouts with low-confidence remasking (the rollouts' sampler, without the options of
    --remasking or STP): {k: (mean over the prompts, its standard error)}."""
    solves = solve_counts(model, task, prompts, PASS_SAMPLES, args, generator, per_call)
    out = {}
    for k in PASS_K:
        values = [pass_at_k(PASS_SAMPLES, c, k) for c in solves]
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        out[k] = (statistics.fmean(values), se)
    return out

# -----------------------------------------------------------------------------
# The SFT model, or with --sft-stop one trained less

def sft_path(args):
    """bgpo.sft_path, or with --sft-stop N that of SFT stopped at step N (lab.control has no --sft-stop)."""
    path, stop = bgpo.sft_path(args), getattr(args, "sft_stop", 0)
    return path[:-len(".pt")] + f"_stop{stop}.pt" if stop else path

def sft_step(model, optimizer, x, y, lr, generator):
    """One step of bgpo.run_sft's loop (a copy): set the learning rate, the SFT loss, backward, clip, step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = sft_loss(model, x, y, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()

def sft_model(args, task):
    """bgpo.sft_model; with --sft-stop N, the model of step N of the same SFT run: N of bgpo.run_sft's steps
    (sft_step; its evaluations draw no random number, so leaving them out changes nothing), trained now
    (--stage sft, or --stage all without the checkpoint) or loaded."""
    if not args.sft_stop:
        return bgpo.sft_model(args, task)
    path = sft_path(args)
    if args.stage != "sft" and os.path.isfile(path):
        print(f"loading the SFT model {path}")
        return bgpo.load_model(path, task, args)
    torch.manual_seed(args.seed)
    model = bgpo.make_model(task, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=bgpo.SFT_LR, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    batches = bgpo.sft_batches(task, args, generator)
    for step in range(1, args.sft_stop + 1):
        sft_step(model, optimizer, *next(batches), bgpo.sft_lr_at(args, step), generator)
    result = evaluate(model, task, test_problems(task, args), args, n_show=0)
    curve = [{"step": args.sft_stop, "accuracy": result["accuracy"], "reward": result["reward"]}]
    bgpo.save_checkpoint(path, task, model.config, stage="sft", step=args.sft_stop, model=model.state_dict(),
                         curve=curve)
    print(f"SFT stopped at step {args.sft_stop} (--sft-stop): progress accuracy {result['accuracy']:.1%} "
          f"({path})")
    return model

def main(argv=None):
    """bgpo.main's steps with the lab's loop: --bench-memory and --prompt as bgpo.py's, else SFT (bgpo.py's),
    run_rl and a summary."""
    args = parse_args(argv)
    task, t0 = get_task(args.task), time.time()
    if args.bench_memory:
        return bgpo.bench_memory(args, task)
    if args.prompt is not None:  # the latest model of the run that the flags name: RL's, else SFT's
        path = os.path.join(args.out_dir, args.run_name, "ckpt.pt")
        path = path if os.path.isfile(path) else sft_path(args)
        answer = bgpo.show_unmasking(bgpo.load_model(path, task, args), task, args.prompt, args)
        print(f"{args.prompt} -> {answer} -> reward {task.reward(args.prompt, answer):.2f} ({path})")
        return answer
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # every progress line reaches a log file as it is printed
    print(f"task {task.name} | device {args.device} | seed {args.seed}")
    run_dir = os.path.join(args.out_dir, args.run_name)
    bgpo.refuse_to_overwrite(args)
    for stale in ("ckpt.pt", "final.json"):   # the replaced run's, and a resumed run is scored again
        if args.stage != "sft" and (args.overwrite or stale == "final.json") and \
                os.path.isfile(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    model = sft_model(args, task)
    if args.stage == "sft":
        return model
    pool = task.sample(args.rl_pool, "train", args.seed + 2)[0] if args.rl_pool else None
    tracked = tracked_answers(model, task, args, args.track_answers) if args.track_answers else None
    history = run_rl(args, task, model, pool, tracked)
    print(f"\nprogress accuracy {history[0]['accuracy']:.1%} -> {history[-1]['accuracy']:.1%} after "
          f"{history[-1]['step']} RL steps ({args.run_name}: {time.time() - t0:.0f} s on {args.device})\n"
          f"files: {sft_path(args)}, {run_dir}/{{ckpt.pt,log.jsonl}}")
    if args.final_eval_size:
        final_evaluation(model, task, args, run_dir, history[-1]["step"])
    if args.plot:
        draw(curves_figure({args.run_name: read_log(os.path.join(run_dir, "log.jsonl"))}),
             os.path.join(run_dir, "curves.png"))
    return history

def final_evaluation(model, task, args, run_dir, step):
    """The SFT model and the final one on the first --final-eval-size test problems (more than the
    progress evaluations' --eval-size, for a smaller sampling error): greedy accuracy and reward, the
    entropy (policy_entropy), and on the first --pass-at-k-size of them pass@k (reach), written to the
    run's final.json. The samples come from a generator of their own: training has ended, and a run
    scored with or without them is the same run."""
    prompts = task.sample(args.final_eval_size, "test", 1234)[0]
    result = {"run": os.path.basename(run_dir), "step": step, "size": len(prompts)}
    models = {"sft_": bgpo.load_model(sft_path(args), task, args), "": model}
    for prefix, scored in models.items():
        greedy = evaluate(scored, task, prompts, args, n_show=0)
        result.update({f"{prefix}accuracy": greedy["accuracy"], f"{prefix}reward": greedy["reward"],
                       f"{prefix}entropy": policy_entropy(scored, task, prompts, args)})
    size = getattr(args, "pass_at_k_size", 0)
    if size:
        t0 = time.time()
        for prefix, scored in models.items():
            generator = torch.Generator().manual_seed(args.seed + 3)   # the same draws for both models
            passes = reach(scored, task, prompts[:size], args, generator)
            result[f"{prefix}pass_at_k"] = {k: mean for k, (mean, _) in passes.items()}
            result[f"{prefix}pass_at_k_se"] = {k: se for k, (_, se) in passes.items()}
        result.update(pass_at_k_size=size, pass_at_k_samples=PASS_SAMPLES, pass_at_k_seconds=time.time() - t0)
    cli.write_json(os.path.join(run_dir, "final.json"), result)
    print(f"on {len(prompts)} test problems: SFT model {result['sft_accuracy']:.1%}, step {step} "
          f"{result['accuracy']:.1%}; entropy {result['sft_entropy']:.3f} -> {result['entropy']:.3f}"
          + (f"; pass@{PASS_SAMPLES} on the first {size} at T {args.temperature}: "
             f"{result['sft_pass_at_k'][PASS_SAMPLES]:.1%} -> {result['pass_at_k'][PASS_SAMPLES]:.1%}"
             if size else "") + f" ({os.path.join(run_dir, 'final.json')})")
    return result

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.rl")
