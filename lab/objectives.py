"""
The field's RL objectives for dLLMs, as Objective values that the lab's RL loop (lab/rl.py) runs:
BGPO and the naive objective (bgpo.py's functions), the naive objective's exact gradient in two passes
and each of BGPO's lemmas alone (what the bound buys, off-policy), d1's diffu-GRPO, STP, dTRPO, SPG (an
upper bound where A < 0), and the control, REINFORCE on the sampler's own trajectory. Run them with
python -m lab.rl --objective NAME.

Each method fixes its randomness once per rollout batch (the Objective's prepare), one draw per
inner update (a prompt mask, n masked copies, one step per block), and computes the rollout
policy's values on those draws; inner update j then compares the current policy with the old one
on draw j, as d1 does with its mask seeds. On-policy every loss has the gradient of
-mean_b A_b X_b / L, with X the method's estimate of log pi(y_b | x): BGPO's, with the ELBO in place
of X. Each loss's docstring lists where it departs from its paper; none has a KL term.
"""
import math
from dataclasses import dataclass, fields
from typing import Callable

import torch

from bgpo import (MCSamples, bgpo_backward, bgpo_bound, check_shapes, draw_mc_samples, elbo_terms,
                  group_advantages, log_ratio, naive_loss, naive_objective, ppo_clip)
from lab.estimators import (check_commit_steps, draw_anchored_masks, draw_block_steps, dtrpo_log_likelihood,
                            one_step_log_likelihood, stp_token_log_likelihood, sudoku_anchors,
                            token_log_probs)
from lab.sampler import Rollouts

PROMPT_MASK_PROB = 0.15  # d1's probability of masking each prompt token

# -----------------------------------------------------------------------------
# The losses of one inner update

def token_grpo_loss(logp, old_logp, advantages, clip_eps=None):
    """d1's per-token GRPO: -(1/BL) sum_{b,i} min(rho_bi A_b, clip(rho_bi, 1 - eps, 1 + eps) A_b), with
    rho_bi = exp(logp_bi - old_logp_bi); logp, old_logp (B, L), advantages (B,); clip_eps None: no clip."""
    if logp.dim() != 2 or tuple(old_logp.shape) != tuple(logp.shape):
        raise ValueError(f"old_logp: expected {tuple(logp.shape)}, got {tuple(old_logp.shape)}")
    if tuple(advantages.shape) != (logp.shape[0],):
        raise ValueError(f"advantages: expected ({logp.shape[0]},), got {tuple(advantages.shape)}")
    return -ppo_clip((logp - old_logp).exp(), advantages.to(logp)[:, None], clip_eps).mean()

def diffu_grpo_loss(model, prompts, completions, prompt_mask, old_logp, advantages, clip_eps=0.5):
    """d1's diffu-GRPO (Zhao et al. 2025), one inner update: token_grpo_loss on the one-step mean-field
    estimate of each token, log p(y^i | x~, completion all MASK), where x~ is the prompt masked at
    prompt_mask (B, P) bool, the same mask for the old and the current policy. old_logp (B, L).
    Departures from d1: 1. group_advantages (z-scored) by default; d1 divides by nothing
    (d1_advantages, python -m lab.rl --advantages no-std, restores it). 2. No KL term (d1: beta 0.04).
    3. mu = 4 inner updates by default (d1: 12). 4. Every completion position counts (d1 stops at the
    first EOS)."""
    if tuple(prompt_mask.shape) != tuple(prompts.shape):
        raise ValueError(f"prompt_mask: expected {tuple(prompts.shape)}, got {tuple(prompt_mask.shape)}")
    x = prompts.masked_fill(prompt_mask.to(prompts.device), model.config.mask_id)
    logp = one_step_log_likelihood(model, x, completions, per_token=True)
    return token_grpo_loss(logp, old_logp, advantages, clip_eps)

def stp_loss(model, prompts, completions, mc, old_logp, advantages, clip_eps=0.2):
    """STP (Liu et al. 2026), one inner update: token_grpo_loss on stp_token_log_likelihood, the per-
    token split of the anchored ELBO over mc's n copies (draw_anchored_masks: anchors never masked).
    The rollouts come from lab.sampler.generate(..., prior=, early_stop=): anchors in place, early stop.
    Departures from STP: 1. per-token terms weighted F/k and from masked positions only (STP's code:
    an unweighted mean over copies, visible positions included). 2. Anchors are Sudoku's given cells,
    not the most confident tokens of an offline LLaDA completion; Countdown and arithmetic have none,
    so there STP is temporal pruning only. 3. The early stop counts tokens in place, tau = 0.75 by
    default (STP: 0.95 of 256 tokens; 0.95 of 10 tokens would be the last token only). 4. No KL
    term (STP: beta 0.04). 5. group_advantages, not STP's (r - mean) / (std + 1e-4)."""
    logp = stp_token_log_likelihood(model, prompts, completions, mc)
    return token_grpo_loss(logp, old_logp, advantages, clip_eps)

def dtrpo_loss(model, prompts, completions, commit_steps, steps, old_value, advantages, clip_eps=0.2,
               block_len=None):
    """dTRPO online, one inner update: the trajectory's log-ratio estimated with one step per block,
    R = dtrpo_log_likelihood(..., steps) (B,), and the sequence ratio rho_b = exp((R_b - R_old_b) / L),
    PPO-clipped: -mean_b min(rho_b A_b, clip(rho_b) A_b), the naive objective with the trajectory in
    place of the ELBO. Departures from dTRPO: 1. the paper's objective is offline DPO against a frozen
    reference (dtrpo_dpo_loss); this is its estimator inside our GRPO loop. 2. The ratio is divided by
    L, as our naive objective's is. 3. One row per block with full attention, not block attention."""
    if tuple(old_value.shape) != (completions.shape[0],):
        raise ValueError(f"old_value: expected ({completions.shape[0]},), got {tuple(old_value.shape)}")
    value = dtrpo_log_likelihood(model, prompts, completions, commit_steps, block_len, steps=steps)
    ratio = ((value - old_value) / completions.shape[1]).exp()
    return -ppo_clip(ratio, advantages.to(ratio), clip_eps).mean()

def dtrpo_dpo_loss(model, reference, prompts, win, win_steps, lose, lose_steps, beta=0.1, block_len=None,
                   steps=None, generator=None):
    """dTRPO as published: DPO on trajectories (offline). For a preferred completion (win, with its
    commit steps) and a dispreferred one of the same prompt, each log-ratio against the frozen
    reference is estimated with one step per block, the same drawn steps for both models:
        L = -mean log sigmoid(beta [(R_theta(w) - R_ref(w)) - (R_theta(l) - R_ref(l))]).
    steps: None to draw, or the (win, lose) steps (B, nb) each."""
    if not beta > 0:
        raise ValueError(f"beta: expected a positive number, got {beta!r}")
    log_ratios = []
    for y, commit, t in ((win, win_steps, None if steps is None else steps[0]),
                         (lose, lose_steps, None if steps is None else steps[1])):
        t = draw_block_steps(commit, block_len, generator) if t is None else t
        with torch.no_grad():
            ref = dtrpo_log_likelihood(reference, prompts, y, commit, block_len, steps=t)
        log_ratios.append(dtrpo_log_likelihood(model, prompts, y, commit, block_len, steps=t) - ref)
    return -torch.nn.functional.logsigmoid(beta * (log_ratios[0] - log_ratios[1])).mean()

def trajectory_backward(model, prompts, completions, commit_steps, advantages):
    """The RL objective on the sampler's own trajectory, -mean_b A_b T(y_b) / L, backpropagated one
    sampler step at a time. T is a sum over steps, so, as in bgpo_backward, the steps' gradients add
    up to the full gradient while only one step's activations are alive. It is on-policy REINFORCE
    (one update per rollout batch): for rollouts at temperature 1 with random remasking, the exact
    policy gradient of the sampler; with low-confidence remasking, the committed tokens' part of it.
    Its gradient is that of BGPO's bound on-policy, with the sampler's steps in place of the ELBO's masks.
    Returns the loss."""
    check_commit_steps(prompts, completions, commit_steps)
    if tuple(advantages.shape) != (completions.shape[0],):
        raise ValueError(f"advantages: expected ({completions.shape[0]},), "
                         f"got shape {tuple(advantages.shape)}")
    L, total = completions.shape[1], 0.0
    for s in range(int(commit_steps.max()) + 1):
        logp = token_log_probs(model, prompts, completions, commit_steps >= s)
        loss = -(advantages.to(logp) * (logp * (commit_steps == s)).sum(1)).mean() / L
        loss.backward()
        total += loss.item()
    return total

# -----------------------------------------------------------------------------
# What BGPO's bound buys: the exact naive gradient in one sample's memory, and each lemma alone

def naive_two_pass_backward(model, prompts, completions, mc, old_terms, advantages, clip_eps=None):
    """The exact gradient of naive_loss, accumulated one MC sample at a time: bgpo_backward's contract
    (calls backward itself, accumulates into .grad, returns the loss value), in the memory of one sample.
    The exp couples the samples only through a number per sequence: with m = mean_j d_j,
        grad R_hat = dR_hat/dm * (1/n_t) sum_j grad d_j,   dR_hat/dm = A e^m, or 0 where PPO clips it,
    so pass 1, without gradients, computes each sequence's c = dR_hat/dm / n_t, and pass 2 backpropagates
    -mean_b c_b d_bj one sample j at a time. On-policy m = 0 and c = A / n_t is known without pass 1:
    the update is then BGPO's, sample for sample. Off-policy pass 1 costs one forward over the n_t copies."""
    check_shapes(prompts, completions, mc, old_terms, advantages)
    n_t, L = mc.weight.shape[1], completions.shape[1]
    if old_terms is None:
        loss, c = -advantages.mean(), advantages / n_t
    else:
        with torch.no_grad():  # pass 1, one sample at a time too, so that no pass holds n_t copies
            terms = torch.cat([elbo_terms(model, prompts, completions, mc[j:j + 1]) for j in range(n_t)], 1)
            d = log_ratio(terms, old_terms, L)                                        # (B, M)
            A, ratio = advantages.to(d), d.mean(1).exp()                              # (B,)
            loss = -naive_objective(d, A, clip_eps).mean()
            # where the min of ppo_clip takes the clipped branch, R_hat is flat in m: c = 0. A tie (the ratio
            # inside the clip range, or on its edge) keeps the full gradient, as autograd's min and clamp do.
            clipped = ppo_clip(ratio, A, clip_eps) < ratio * A
            c = torch.where(clipped, 0.0, A * ratio) / n_t
    for j in range(n_t):                                                              # pass 2
        terms = elbo_terms(model, prompts, completions, mc[j:j + 1])                  # (B, 1)
        d = log_ratio(terms, None if old_terms is None else old_terms[:, j:j + 1], L)
        (-(c.to(d) * d[:, 0]).mean()).backward()
    return float(loss)

def lemma1_bound(d, A, n_t, clip_eps=None):
    """Lemma 1 alone: the tangent line (1 + d_j) A / n_t for every sign of A. Summed over the n_t
    samples, (1 + m) A: below R_hat = e^m A where A >= 0 (e^m >= 1 + m), above it where A < 0. With
    PPO's clip (per sample) it stays below where A >= 0; where A < 0 it can then lie on either side."""
    return ppo_clip(1 + d, A[:, None], clip_eps) / n_t

def lemma2_bound(d, A, n_t, clip_eps=None):
    """Lemma 2 alone: e^{d_j} A / n_t for every sign of A. Summed, mean_j(e^{d_j}) A: below R_hat where
    A <= 0 (Jensen: mean_j e^{d_j} >= e^m), above it where A > 0. With PPO's clip (per sample) it stays
    below where A <= 0; where A > 0 it can then lie on either side."""
    return ppo_clip(d.exp(), A[:, None], clip_eps) / n_t

def bound_backward(model, prompts, completions, mc, old_terms, advantages, bound=bgpo_bound, clip_eps=None):
    """bgpo_backward (mc_chunk 1) with another sum of per-sample terms: bound(d, A, n_t, clip_eps) -> (B, M),
    lemma1_bound or lemma2_bound. With bgpo_bound it is bgpo_backward."""
    check_shapes(prompts, completions, mc, old_terms, advantages)
    n_t, L, total = mc.weight.shape[1], completions.shape[1], 0.0
    for j in range(n_t):
        terms = elbo_terms(model, prompts, completions, mc[j:j + 1])                  # (B, 1)
        d = log_ratio(terms, None if old_terms is None else old_terms[:, j:j + 1], L)
        loss = -bound(d, advantages.to(d), n_t, clip_eps).sum(1).mean()
        loss.backward()
        total += loss.item()
    return total

# -----------------------------------------------------------------------------
# SPG (Wang et al., arXiv 2510.09541): an upper bound of log pi where A < 0

SPG_BETA, SPG_MIX = 2.0, 0.5   # the public code's beta for Countdown, and its mixture weight omega

def copy_token_log_probs(model, prompts, completions, mc):
    """log p(y^i | y with S_j masked, x) of every position of every copy j: (B, M, L), one graph."""
    check_shapes(prompts, completions, mc)
    (B, M, L) = mc.mask.shape
    x, y = prompts.repeat_interleave(M, 0), completions.repeat_interleave(M, 0)
    return token_log_probs(model, x, y, mc.mask.reshape(B * M, L).to(y.device)).view(B, M, L)

def spg_eubo(logp, mc, beta=SPG_BETA):
    """SPG's evidence upper bound per token, in its public code's form: for each position i,
        a_i = (1/M) sum_j w_j 1[i in S_j] p(y^i | y with S_j masked, x)^beta,
    and (1/beta) log a_i averaged over the positions masked in some copy: (B,). logp (B, M, L) from
    copy_token_log_probs. Why a bound: in a random order sigma, token i is written given c_i(sigma) =
    p(y^i | the tokens before it), and pi(y) = E_sigma[prod_i c_i]. The weighted copies make a_i unbiased
    for E_sigma[c_i^beta], and Hölder's inequality gives E[prod_i c_i] <= prod_i E[c_i^L]^(1/L), with
    E[c^beta]^(1/beta) growing in beta: so (1/beta) sum_i log E_sigma[c_i^beta] >= log pi(y) for beta >= L.
    For beta < L (the code's 2.0 on Countdown) nothing guarantees it, and the log of an M-copy mean falls
    below the log of its expectation (Jensen). The lab's tests enumerate both."""
    w = mc.weight.to(logp).log()[:, :, None]                                           # (B, M, 1)
    log_terms = (beta * logp + w).masked_fill(~mc.mask, -math.inf)                     # log(w p^beta)
    seen = mc.mask.any(1)                                                              # (B, L)
    # a position masked in no copy: 0 in place of a column of -inf (whose logsumexp has a NaN gradient)
    log_a = log_terms.masked_fill(~seen[:, None], 0.0).logsumexp(1) - math.log(logp.shape[1])
    return (log_a * seen).sum(1) / seen.sum(1).clamp(min=1) / beta

def spg_loss(model, prompts, completions, mc, advantages, beta=SPG_BETA, mix=SPG_MIX):
    """SPG's on-policy loss, -mean_b A_b X_b, in one graph over the M copies (the log of a mean over copies
    is not a sum of per-copy terms: memory grows with M, as the naive objective's):
        X_b = ELBO_b / L                                   where A_b > 0,
        X_b = mix EUBO_b + (1 - mix) ELBO_b / L            where A_b < 0 (mix = 1: the upper bound alone),
    with ELBO_b the mean of elbo_terms over the copies and EUBO_b spg_eubo. With mix = 0 it is BGPO's
    on-policy update. Departures from SPG: 1. the ELBO is elbo_terms' 1/t-weighted estimate (its code:
    the mean of the masked tokens' log-probabilities, unweighted). 2. Our stratified copies (its code:
    num_t = 2 block masks, and 15% of the visible tokens masked too). 3. The lab's advantages (its code:
    r - mean, no std). 4. One update per rollout batch, no ratio, no clip (its code: REINFORCE, mu
    updates). As in its code, the bound averages over the positions masked in some copy, the ELBO over
    all L."""
    check_shapes(prompts, completions, mc, None, advantages)
    logp = copy_token_log_probs(model, prompts, completions, mc)                      # (B, M, L)
    elbo = (mc.weight.to(logp) * (logp * mc.mask).sum(2)).mean(1) / completions.shape[1]   # (B,)
    A = advantages.to(logp)
    X = torch.where(A > 0, elbo, mix * spg_eubo(logp, mc, beta) + (1 - mix) * elbo)
    return -(A * X).mean()

# -----------------------------------------------------------------------------
# BGPO with levers that spend the policy's entropy slower (Cui et al., arXiv 2505.22617), one copy at a time

def highest_covariance(logp, A, mask, fraction):
    """The masked positions in the top `fraction` (at least one) of a copy's masked positions in the batch by
        cov_i = (log p_i - mean log p) (A_b - mean A),
    means over the copy's masked positions and the batch's rows: (B, L) bool. logp (B, L) detached, A (B,).
    A negative fraction takes the bottom -fraction instead. Cui et al.'s lemma: a softmax policy's entropy
    changes by about -Cov(log pi, its logits' change), and a policy-gradient step moves a logit with A; so
    positive cov (a confident token of a rewarded row, a rare one of a punished row) is what lowers the
    entropy at the position updated."""
    n = int(mask.sum())
    if n == 0:
        return mask.clone()
    mean_logp = (logp * mask).sum() / n
    sign = 1 if fraction > 0 else -1   # the bottom by cov is the top by -cov
    cov = (sign * (logp - mean_logp) * (A - A.mean())[:, None]).masked_fill(~mask, -math.inf)
    top = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    top[cov.flatten().topk(max(1, round(abs(fraction) * n))).indices] = True
    return top.view_as(mask) & mask

def spared_bgpo_backward(model, prompts, completions, mc, old_terms, advantages, clip_eps=None,
                         cov_detach=0.0, entropy_coef=0.0):
    """bgpo_backward, one copy per backward (memory flat in n_t), with two levers, each off at 0:
    cov_detach: in each copy, the highest_covariance fraction of its masked positions keep their
        log-probability in the value of l_j but lose its gradient (Clip-Cov's detach, on KL-Cov's top-k
        choice; per copy of the ELBO rather than per token of one sequence, and the top fraction rather than
        Clip-Cov's random share of a covariance band); negative: the lowest-covariance -cov_detach instead.
    entropy_coef: minus entropy_coef times the mean entropy of the copy's predictions at its masked
        positions, / n_t, joins the loss: a bonus for spread predictions where the ELBO looks.
    With both at 0 it is bgpo_backward with mc_chunk 1 (a test compares the two)."""
    check_shapes(prompts, completions, mc, old_terms, advantages)
    (B, n_t, L), P, total = mc.mask.shape, prompts.shape[1], 0.0
    for j in range(n_t):
        mask = mc.mask[:, j].to(completions.device)                                        # (B, L)
        y_t = completions.masked_fill(mask, model.config.mask_id)
        logq = model(torch.cat([prompts, y_t], dim=1))[:, P:].log_softmax(-1)              # (B, L, V)
        logp = logq.gather(-1, completions[..., None])[..., 0]                             # (B, L)
        if cov_detach:   # negative: the bottom by covariance
            detached = highest_covariance(logp.detach(), advantages.to(logp), mask, cov_detach)
            logp = torch.where(detached, logp.detach(), logp)
        terms = mc.weight[:, j:j + 1].to(logp) * (logp * mask).sum(-1, keepdim=True)       # (B, 1)
        d = log_ratio(terms, None if old_terms is None else old_terms[:, j:j + 1], L)
        loss = -bgpo_bound(d, advantages.to(d), n_t, clip_eps).sum(1).mean()
        if entropy_coef > 0:
            entropy = -(logq.exp() * logq.nan_to_num(0.0)).sum(-1)   # MASK's -inf: 0 * -inf -> 0
            loss = loss - entropy_coef * (entropy * mask).sum() / mask.sum().clamp(min=1) / n_t
        loss.backward()
        total += loss.item()
    return total

# -----------------------------------------------------------------------------
# The objectives: what each fixes once per rollout batch, and its inner update j

@dataclass
class Objective:
    """An RL objective as the lab's loop sees it.
    prepare(model, batch, args, generator) -> state, fixed once per rollout batch, without gradients;
    backward(model, batch, state, A, args, inner) -> loss value, backpropagated for inner update `inner`;
    row_mean: whether the loss is a mean over the batch's rows. lab.rl then builds the update from the rows
    with A > 0 and those with A < 0 apart, for its diagnostics (the parts add up to the whole update). A
    loss normalised over the whole batch, or pairing rows within a group, sets False: one backward."""
    prepare: Callable
    backward: Callable
    row_mean: bool = True

def rows_of(value, rows):
    """The part of a rollout batch, or of an objective's per-batch state, that belongs to these rows."""
    if isinstance(value, dict):
        return {k: rows_of(v, rows) for k, v in value.items()}
    if isinstance(value, (MCSamples, Rollouts)):
        return type(value)(*(rows_of(getattr(value, f.name), rows) for f in fields(value)))
    if isinstance(value, list):
        return [v for v, keep in zip(value, rows.tolist()) if keep]
    return None if value is None else value[rows.to(value.device)]

def informative(batch, state, A):
    """As bgpo.run_rl's update: drop the rows with A = 0, scale the others' A by their share of the rows."""
    rows = A != 0
    return rows_of(batch, rows), rows_of(state, rows), A[rows] * (int(rows.sum()) / len(A))

def off_policy(args):
    """Whether some update of a rollout batch comes after another: then the policy that sampled it is
    no longer the current one, and the update needs its terms (old_terms) and the PPO clip."""
    return args.updates_per_batch > 1 or args.minibatches > 1

def clip_of(args):
    return args.clip_eps if off_policy(args) else None   # on-policy the clip is inactive anyway

def elbo_draws(model, batch, args, generator):
    """BGPO's and the naive objective's: n_t masked copies per completion, and the rollout policy's terms
    on the same masks when several updates use one batch (bgpo.run_rl's step 4)."""
    mc = draw_mc_samples(len(batch.prompts), batch.y.shape[1], args.mc_samples, generator).to(args.device)
    if not off_policy(args):
        return {"mc": mc, "old_terms": None}
    with torch.no_grad():
        return {"mc": mc, "old_terms": elbo_terms(model, batch.x, batch.y, mc)}       # (B, M)

def bgpo_update(model, batch, state, A, args, inner=0):
    batch, state, A = informative(batch, state, A)
    cov_detach, entropy_coef = getattr(args, "cov_detach", 0.0), getattr(args, "entropy_coef", 0.0)
    if cov_detach or entropy_coef:   # lab.rl's entropy levers; off, bgpo.py's update
        return spared_bgpo_backward(model, batch.x, batch.y, state["mc"], state["old_terms"], A,
                                    clip_of(args), cov_detach, entropy_coef)
    return bgpo_backward(model, batch.x, batch.y, state["mc"], state["old_terms"], A, clip_of(args),
                         args.mc_chunk)

def naive_update(model, batch, state, A, args, inner=0):
    batch, state, A = informative(batch, state, A)
    loss = naive_loss(model, batch.x, batch.y, state["mc"], state["old_terms"], A, clip_of(args))
    loss.backward()
    return loss.item()

def naive_two_pass_update(model, batch, state, A, args, inner=0):
    batch, state, A = informative(batch, state, A)
    return naive_two_pass_backward(model, batch.x, batch.y, state["mc"], state["old_terms"], A, clip_of(args))

def bound_update(bound):
    """The update of a bound of R_hat built from per-sample terms (bgpo_bound or a lemma alone)."""
    def update(model, batch, state, A, args, inner=0):
        batch, state, A = informative(batch, state, A)
        x, y, mc, old_terms = batch.x, batch.y, state["mc"], state["old_terms"]
        return bound_backward(model, x, y, mc, old_terms, A, bound, clip_of(args))
    return update

@torch.no_grad()
def diffu_grpo_draws(model, batch, args, generator):
    """d1: a prompt mask per inner update, and the rollout policy's per-token one-step terms under it."""
    x, y, mu = batch.x, batch.y, args.updates_per_batch
    hide = (torch.rand(x.shape[0], mu, x.shape[1], generator=generator) < PROMPT_MASK_PROB).to(x.device)
    old = [one_step_log_likelihood(model, x.masked_fill(hide[:, j], model.config.mask_id), y, per_token=True)
           for j in range(mu)]
    return {"prompt_mask": hide, "old": torch.stack(old, 1)}                     # (B, mu, P), (B, mu, L)

def diffu_grpo_update(model, batch, state, A, args, inner):
    loss = diffu_grpo_loss(model, batch.x, batch.y, state["prompt_mask"][:, inner], state["old"][:, inner], A,
                           clip_of(args))
    loss.backward()
    return loss.item()

@torch.no_grad()
def stp_draws(model, batch, args, generator):
    """STP: --mc-samples (num_t) anchored masked copies per inner update, and the rollout policy's
    per-token terms on them. The anchors are Sudoku's given cells (args.anchors), else none."""
    (B, L), mu, n = batch.y.shape, args.updates_per_batch, args.mc_samples
    anchors = sudoku_anchors(batch.prompts) if args.anchors else torch.zeros(B, L, dtype=torch.bool)
    mc = draw_anchored_masks(anchors, mu * n, generator)
    mc = MCSamples(mc.mask.view(B, mu, n, L), mc.weight.view(B, mu, n)).to(batch.x.device)
    old = [stp_token_log_likelihood(model, batch.x, batch.y, mc[j]) for j in range(mu)]
    return {"mc": mc, "old": torch.stack(old, 1)}

def stp_update(model, batch, state, A, args, inner):
    loss = stp_loss(model, batch.x, batch.y, state["mc"][inner], state["old"][:, inner], A, clip_of(args))
    loss.backward()
    return loss.item()

@torch.no_grad()
def dtrpo_draws(model, batch, args, generator):
    """dTRPO: one sampler step per block per inner update, and the rollout policy's estimate on them."""
    c, mu = batch.commit_steps, args.updates_per_batch
    t = torch.stack([draw_block_steps(c, args.block_len, generator) for _ in range(mu)], 1)     # (B, mu, nb)
    old = [dtrpo_log_likelihood(model, batch.x, batch.y, c, args.block_len, steps=t[:, j]) for j in range(mu)]
    return {"steps": t, "old": torch.stack(old, 1)}

def dtrpo_update(model, batch, state, A, args, inner):
    loss = dtrpo_loss(model, batch.x, batch.y, batch.commit_steps, state["steps"][:, inner],
                      state["old"][:, inner], A, clip_of(args), args.block_len)
    loss.backward()
    return loss.item()

def spg_update(model, batch, state, A, args, inner=0):
    batch, state, A = informative(batch, state, A)
    loss = spg_loss(model, batch.x, batch.y, state["mc"], A, args.spg_beta, args.spg_mix)
    loss.backward()
    return loss.item()

def no_draws(model, batch, args, generator):
    return None                                       # the trajectory control reads the rollouts' own steps

def trajectory_update(model, batch, state, A, args, inner):
    return trajectory_backward(model, batch.x, batch.y, batch.commit_steps, A)

OBJECTIVES = {"bgpo": Objective(elbo_draws, bgpo_update), "naive": Objective(elbo_draws, naive_update),
              "naive-two-pass": Objective(elbo_draws, naive_two_pass_update),
              "lemma1-only": Objective(elbo_draws, bound_update(lemma1_bound)),
              "lemma2-only": Objective(elbo_draws, bound_update(lemma2_bound)),
              "diffu-grpo": Objective(diffu_grpo_draws, diffu_grpo_update),
              "stp": Objective(stp_draws, stp_update), "dtrpo": Objective(dtrpo_draws, dtrpo_update),
              "spg": Objective(elbo_draws, spg_update), "trajectory": Objective(no_draws, trajectory_update)}

def reward_groups(rewards, group_size):
    """(B,) rewards of consecutive groups of group_size rollouts -> (B / G, G), with bgpo.group_advantages's
    checks (copied)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected (B,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size: must be an int >= 2 dividing {rewards.shape[0]}, got {group_size!r}")
    return rewards.view(-1, group_size)

def d1_advantages(rewards, group_size):
    """d1's advantage: the reward minus its group's mean, not divided by the group's std."""
    r = reward_groups(rewards, group_size)
    return (r - r.mean(1, keepdim=True)).flatten()

def rft_advantages(rewards, group_size):
    """Rejection-sampling fine-tuning (RFT; STaR, filtered behaviour cloning) as an advantage: 1 for a solved
    rollout (reward 1), 0 for the rest. With it an ELBO objective is the SFT loss on the policy's own solved
    answers: no group baseline, no negative advantage."""
    return (reward_groups(rewards, group_size) == 1.0).to(rewards.dtype).flatten()

def w_reinforce_advantages(rewards, group_size):
    """W-REINFORCE (Zhu et al., arXiv 2506.01347): +0.1 for a solved rollout, -1 for the rest (a well-formed
    wrong answer, reward 0.1, included); no baseline. The solved answers weigh a tenth as much as the
    unsolved ones."""
    solved = reward_groups(rewards, group_size) == 1.0
    return torch.where(solved, 0.1, -1.0).to(rewards.dtype).flatten()

# --advantages of python -m lab.rl: rewards (B,) of consecutive groups -> advantages (B,)
ADVANTAGES = {"group": group_advantages, "no-std": d1_advantages, "rft": rft_advantages,
              "w-reinforce": w_reinforce_advantages}

def stp_prior(task, prompts):
    """STP's static prior as generate's prior=: (B, L) token ids, MASK at the free positions. On
    Sudoku, the given cells (the completion repeats the grid); the other tasks have none: None."""
    if task.name != "sudoku":
        return None
    grid = task.tokenizer.encode_batch([p.replace("|", "") for p in prompts], task.gen_len, "right")
    return grid.masked_fill(~sudoku_anchors(prompts), task.tokenizer.mask_id)

def sampler_options(task, prompts, args):
    """The rollouts' sampler options in lab.rl, for lab.sampler.sample_rollouts: --remasking, and STP's
    anchors and early stop. prompts: the prompt strings, before each is repeated G times."""
    prior = stp_prior(task, [p for p in prompts for _ in range(args.group_size)]) if args.anchors else None
    return {"remasking": args.remasking, "prior": prior, "early_stop": args.stp_tau}

def flat_grad(model, grads=None):
    """The accumulated gradient, or the given per-parameter gradients (torch.autograd.grad's), as one flat
    vector, with zeros for the parameters that backward did not reach."""
    grads = [p.grad for p in model.parameters()] if grads is None else grads
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                      for p, g in zip(model.parameters(), grads)])
