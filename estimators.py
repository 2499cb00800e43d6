"""
The other ways the field estimates a dLLM's log-likelihood for RL, and a lab that measures every
estimator against exact enumeration: the BGPO paper's Fig. 3, in small.

An RL objective for a masked diffusion LM needs log pi_theta(y|x), which is intractable. BGPO
(bgpo.py) estimates the ELBO with n_t masked copies. The other methods:
- coupled masks: DiffuCoder (Gong et al. 2025, coupled-GRPO) scores each token once with a mask
  and once with its complement; antithetic_elbo is a pair of our design that stays unbiased;
- d1's diffu-GRPO (Zhao et al. 2025): one forward pass with the whole completion masked, prompt
  tokens masked with probability 0.15 (a mean-field approximation);
- the sampler's own trajectory (TraceRL-style), and dTRPO ("Trajectory Reduction in Policy
  Optimization of Diffusion LLMs", 2026): only the tokens newly unmasked at one sampled step per block;
- STP ("Efficient and Stable RL for Diffusion Language Models", Liu et al. 2026): anchor tokens
  from a static prior that are never masked (spatial pruning).
Completions here have 4-16 tokens, so every estimator's mean and variance can be computed exactly,
by enumerating its randomness (mask sets, steps, prompt masks) with their probabilities.

Read in this order: 1. the estimators, 2. their exact moments, 3. the lab
(`python bgpo.py --bench-estimators`), which prints a likelihood table, the Fig. 3 gradient table,
and the signal-to-noise of the RL gradient, 4. the three methods as RL objectives
(`python bgpo.py --objective diffu-grpo | stp | dtrpo`, and dTRPO's own offline DPO,
`--dtrpo-offline`); each loss's docstring lists where it departs from its paper.

Where the toy versions depart from their papers:
1. DiffuCoder draws one mask ratio t for the whole batch; here each sequence draws its own, so
   sequences are independent draws.
2. d1 masks every prompt position with probability 0.15, padding included; so does
   one_step_log_likelihood. d1 averages per-token terms over the batch's tokens; the lab's
   surrogate divides by L, the same thing when every completion has L tokens (ours do).
3. dTRPO uses block attention to fit all of a sequence's sampled states into one row; with full
   attention we use one row per block, all blocks in one batched forward. The step of a block is
   drawn among the steps that committed at least one of its tokens (a step that commits nothing adds
   0 to the sum, so the estimate stays unbiased, with a smaller scale and variance).
4. STP: the count-form ELBO restricted to the free positions (weight F/k), not the STP code's
   unweighted per-token mean over masked copies; the anchors are Sudoku's given cells, not the
   highest-confidence tokens of an offline LLaDA completion. Temporal pruning (early stop) changes
   rollouts, not the estimator: it is generate's early_stop (tiny_dllm.py).

Shapes: B batch, L completion length, P prompt length, K sampler steps, N enumerated sets.
"""
import contextlib
import copy
import json
import math
import os
import time

import numpy as np
import torch

from bgpo import (ActivationMemory, MCSamples, RunError, _ppo, bgpo_backward, draw, draw_mc_samples, elbo_from_table,
                  elbo_terms, encode, evaluate, group_advantages, log_probs_under_every_mask, naive_loss, random_order_from_table,
                  reward_groups, subset_masks)
from tiny_dllm import generate, mask_by_count, masked_log_likelihood

# -----------------------------------------------------------------------------
# 1. The estimators: each returns one value per sequence, (B,), in nats, with gradients


def _check_batch(prompts, completions):
    if prompts.dim() != 2 or completions.dim() != 2 or prompts.shape[0] != completions.shape[0]:
        raise ValueError(f"prompts, completions: expected (B, P) and (B, L), got {tuple(prompts.shape)} and "
                         f"{tuple(completions.shape)}")


def antithetic_elbo(model, prompts, completions, generator=None):
    """A coupled pair of our design, unbiased for the ELBO. Draw k ~ U{1..L} and a uniform k-subset S
    as in the count form; its complement S^c is then a uniform (L-k)-subset, and
        X = 1/2 [ (L/k) a(S) + (L/(L-k)) a(S^c) ]     for k < L
        X = a(all positions)                         for k = L, whose complement is empty,
    with a(S) = sum_{i in S} log p(y^i | y with S masked, x). With e_k the mean of (L/k) a(S) over
    k-subsets, E[X] = (1/L) [sum_{k<L} (e_k + e_{L-k}) / 2 + e_L] = (1/L) sum_k e_k = the ELBO.
    Every token is scored exactly once. Two forward passes per pair."""
    _check_batch(prompts, completions)
    B, L = completions.shape
    k = torch.randint(1, L + 1, (B,), generator=generator)
    S = mask_by_count(k, L, generator)
    full = k == L
    S_c = torch.where(full[:, None], S, ~S)
    dtype = torch.get_default_dtype()
    w = torch.stack([L / k.to(dtype), torch.where(full, 1.0, L / (L - k).clamp(min=1).to(dtype))])  # (2, B)
    logp = masked_log_likelihood(model, prompts.repeat(2, 1), completions.repeat(2, 1),
                                 torch.cat([S, S_c]).to(completions.device))
    return (w.to(logp).flatten() * logp).view(2, B).mean(0)


def diffucoder_coupled(model, prompts, completions, generator=None, per_token=False):
    """DiffuCoder's coupled estimate as published: t ~ U(0.2, 0.8), each position masked with
    probability t (the set S), and three forward passes: all masked, S masked, S^c masked. Per token
        l_i = 1/2 [ log p(y^i | all masked) + 1[i in S]/t log p(y^i | S masked)
                                            + 1[i not in S]/(1-t) log p(y^i | S^c masked) ].
    Biased for both the ELBO and log pi: its mean is half the one-step mean field plus the ELBO's
    t-integrand averaged over [0.2, 0.8] instead of [0, 1] (the two masked halves each count once)."""
    _check_batch(prompts, completions)
    B, L = completions.shape
    t = 0.2 + 0.6 * torch.rand(B, 1, generator=generator)
    S = torch.rand(B, L, generator=generator) < t
    masks = torch.cat([torch.ones_like(S), S, ~S]).to(completions.device)
    logp = masked_log_likelihood(model, prompts.repeat(3, 1), completions.repeat(3, 1), masks, per_token=True)
    logp, S, t = logp.view(3, B, L), S.to(logp.device), t.to(logp)
    l = 0.5 * (logp[0] + S * logp[1] / t + ~S * logp[2] / (1 - t))                  # (B, L)
    return l if per_token else l.sum(1)


def one_step_log_likelihood(model, prompts, completions, prompt_mask_prob=0.0, generator=None, per_token=False):
    """d1's mean-field estimate (diffu-GRPO): log pi(y|x) ~ sum_i log p(y^i | x~, completion all MASK),
    one forward pass, where x~ is the prompt with each position masked with probability
    prompt_mask_prob (d1: 0.15). With 0 it is deterministic. Biased for log pi and for the ELBO:
    every token is predicted with no completion context at all."""
    _check_batch(prompts, completions)
    if not 0.0 <= prompt_mask_prob < 1.0:
        raise ValueError(f"prompt_mask_prob: expected a probability in [0, 1), got {prompt_mask_prob!r}")
    if prompt_mask_prob > 0:
        hide = torch.rand(prompts.shape, generator=generator) < prompt_mask_prob
        prompts = prompts.masked_fill(hide.to(prompts.device), model.config.mask_id)
    everything = torch.ones_like(completions, dtype=torch.bool)
    logp = masked_log_likelihood(model, prompts, completions, everything, per_token=True)   # (B, L)
    return logp if per_token else logp.sum(1)


def _check_commit_steps(prompts, completions, commit_steps):
    _check_batch(prompts, completions)
    if tuple(commit_steps.shape) != tuple(completions.shape):
        raise ValueError(f"commit_steps: expected {tuple(completions.shape)}, got {tuple(commit_steps.shape)}")
    if (commit_steps < 0).any():
        raise ValueError("commit_steps: every position must have been committed (a step >= 0)")


def trajectory_log_likelihood(model, prompts, completions, commit_steps, per_token=False):
    """The sum over sampler steps s of the log-probability of the tokens committed at step s, given
    the state before it (the positions committed at steps >= s still masked):
        T(y) = sum_s sum_{i: commit_i = s} log p(y^i | y with {j: commit_j >= s} masked, x).
    commit_steps (B, L) is what generate(..., return_steps=True) records. What it is: with random
    remasking (positions chosen uniformly), the trajectory's log-probability is T(y) plus the log-
    probability of the chosen positions, a term that does not depend on the model, so T carries all
    of its gradient. With low-confidence remasking (generate's), which positions are committed depends
    on the model's confidences; T leaves that choice out. One forward pass per step, K in all."""
    _check_commit_steps(prompts, completions, commit_steps)
    B, L = completions.shape
    K = int(commit_steps.max()) + 1
    s = torch.arange(K, device=commit_steps.device)[None, :, None]
    masked_before = commit_steps[:, None, :] >= s                                    # (B, K, L)
    logp = masked_log_likelihood(model, prompts.repeat_interleave(K, 0), completions.repeat_interleave(K, 0),
                                 masked_before.flatten(0, 1), per_token=True).view(B, K, L)
    per_position = (logp * (commit_steps[:, None, :] == s)).sum(1)                  # each token at its own step
    return per_position if per_token else per_position.sum(1)


def trajectory_backward(model, prompts, completions, commit_steps, advantages):
    """The RL objective on the sampler's own trajectory, -mean_b A_b T(y_b) / L, backpropagated one
    sampler step at a time. T is a sum over steps, so, as in bgpo_backward, the steps' gradients add
    up to the full gradient while only one step's activations are alive. It is on-policy REINFORCE
    (one update per rollout batch): for rollouts at temperature 1 with random remasking, the exact
    policy gradient of the sampler; with low-confidence remasking, the committed tokens' part of it.
    Its gradient is that of BGPO's bound on-policy, with the sampler's steps in place of the ELBO's masks.
    Returns the loss."""
    _check_commit_steps(prompts, completions, commit_steps)
    if tuple(advantages.shape) != (completions.shape[0],):
        raise ValueError(f"advantages: expected ({completions.shape[0]},), got shape {tuple(advantages.shape)}")
    L, total = completions.shape[1], 0.0
    for s in range(int(commit_steps.max()) + 1):
        logp = masked_log_likelihood(model, prompts, completions, commit_steps >= s, per_token=True)
        loss = -(advantages.to(logp) * (logp * (commit_steps == s)).sum(1)).mean() / L
        loss.backward()
        total += loss.item()
    return total


def _steps_of_blocks(commit_steps, block_len):
    """(B, nb, K) bool: step s committed at least one token of block b."""
    K = int(commit_steps.max()) + 1
    steps = torch.arange(K, device=commit_steps.device)
    return torch.stack([(blk[..., None] == steps).any(1) for blk in commit_steps.split(block_len, 1)], 1)


def draw_block_steps(commit_steps, block_len=None, generator=None):
    """dTRPO's draw: for each block, one step t_b uniform among the K_b steps that committed its
    tokens (B, nb). A step that commits nothing in the block would add 0; it is never drawn."""
    present = _steps_of_blocks(commit_steps, block_len or commit_steps.shape[1])
    scores = torch.rand(present.shape, generator=generator).to(present.device).masked_fill(~present, -1.0)
    return scores.argmax(-1)


def dtrpo_log_likelihood(model, prompts, completions, commit_steps, block_len=None, generator=None, steps=None):
    """dTRPO's estimate of T(y) (trajectory_log_likelihood): in each block b, one step t_b drawn
    uniformly among the K_b steps that committed the block's tokens (draw_block_steps, or given as
    steps (B, nb)), scaled by K_b:
        X = sum_b K_b sum_{i in b: commit_i = t_b} log p(y^i | y with {j: commit_j >= t_b} masked, x).
    E_{t_b}[K_b Delta_{t_b}] = sum_{t in block b} Delta_t, so E[X] = T(y): unbiased for the trajectory
    sum, with one forward pass per block instead of one per step (all blocks in one batch)."""
    _check_commit_steps(prompts, completions, commit_steps)
    (B, L), block_len = completions.shape, block_len or completions.shape[1]
    present = _steps_of_blocks(commit_steps, block_len)                               # (B, nb, K)
    t = draw_block_steps(commit_steps, block_len, generator) if steps is None else steps.to(commit_steps.device)
    if tuple(t.shape) != tuple(present.shape[:2]):
        raise ValueError(f"steps: expected {tuple(present.shape[:2])} (one step per block), got {tuple(t.shape)}")
    nb = t.shape[1]
    block = torch.arange(L, device=commit_steps.device) // block_len                 # (L,)
    states = commit_steps[:, None] >= t[..., None]                                   # (B, nb, L): before step t_b
    new = (commit_steps[:, None] == t[..., None]) & (block == torch.arange(nb, device=block.device)[:, None])
    logp = masked_log_likelihood(model, prompts.repeat_interleave(nb, 0), completions.repeat_interleave(nb, 0),
                                 states.flatten(0, 1), per_token=True).view(B, nb, L)
    return (present.sum(-1).to(logp) * (logp * new).sum(-1)).sum(1)


def draw_anchored_masks(anchors, n=1, generator=None):
    """STP's spatial pruning as a draw: n masked copies per sequence in which the anchors (B, L) bool
    are never masked. With F free positions, each copy draws k ~ U{1..F} and a uniform k-subset S of
    the free positions. Returns MCSamples: mask (B, n, L) and weight F/k (B, n)."""
    if anchors.dim() != 2 or anchors.dtype != torch.bool:
        raise ValueError(f"anchors: expected a (B, L) bool tensor, got {tuple(anchors.shape)} {anchors.dtype}")
    anchors = anchors.cpu()
    F = (~anchors).sum(1, keepdim=True)                                               # (B, 1)
    if (F == 0).any():
        raise ValueError("anchors: every sequence needs at least one free position")
    k = (torch.rand(anchors.shape[0], n, generator=generator) * F).long() + 1        # U{1..F}
    scores = torch.rand(*k.shape, anchors.shape[1], generator=generator).masked_fill(anchors[:, None], 2.0)
    S = scores.argsort(-1).argsort(-1) < k[..., None]                                # anchors rank last
    return MCSamples(S, (F / k).to(torch.get_default_dtype()))


def stp_token_log_likelihood(model, prompts, completions, mc):
    """Per token, (B, L): l_i = (1/n) sum_j w_j 1[i in S_j] log p(y^i | y with S_j masked, x), for the
    n copies of draw_anchored_masks. Its sum over i is the mean of n draws of stp_log_likelihood.
    The B*n copies go through the model as one batch, so memory grows with n (as in STP's code)."""
    _check_batch(prompts, completions)
    B, L = completions.shape
    if mc.mask.dim() != 3 or tuple(mc.mask.shape[::2]) != (B, L):
        raise ValueError(f"mc.mask: expected ({B}, n, {L}), got {tuple(mc.mask.shape)}")
    n = mc.mask.shape[1]
    mask = mc.mask.to(completions.device)
    logp = masked_log_likelihood(model, prompts.repeat_interleave(n, 0), completions.repeat_interleave(n, 0),
                                 mask.flatten(0, 1), per_token=True).view(B, n, L)
    return (mc.weight.to(logp)[..., None] * mask * logp).mean(1)


def stp_log_likelihood(model, prompts, completions, anchors, generator=None):
    """STP's spatial pruning, in ELBO form: the anchors (B, L) bool are never masked. With F free
    positions, k ~ U{1..F}, S a uniform k-subset of the free positions, X = (F/k) a(S). Unbiased for
    the ELBO of the free tokens given the anchors (the anchors move into the context). We use this
    form rather than the STP code's unweighted mean over masked copies because it is an ELBO: its
    bias and variance sit in the same table as BGPO's, and it drops into BGPO's bound unchanged.
    With no anchors it is the count form of the ELBO."""
    _check_batch(prompts, completions)
    if tuple(anchors.shape) != tuple(completions.shape):
        raise ValueError(f"anchors: expected {tuple(completions.shape)}, got {tuple(anchors.shape)}")
    return stp_token_log_likelihood(model, prompts, completions, draw_anchored_masks(anchors, 1, generator)).sum(1)


def sudoku_anchors(prompts):
    """STP's static prior on Sudoku: the given cells, which the completion (the full grid) repeats."""
    return torch.tensor([[c != "." for c in p.replace("|", "")] for p in prompts])


def average_of_draws(estimator, n, model, prompts, completions, *per_row, **options):
    """The mean of n independent draws of an estimator, as one batch of n * B rows: its memory
    grows with n (what a batched implementation of these methods does)."""
    B = prompts.shape[0]
    rep = [t.repeat_interleave(n, 0) for t in (prompts, completions, *per_row)]
    return estimator(model, *rep, **options).view(B, n).mean(1)


# -----------------------------------------------------------------------------
# 2. Exact moments: every estimator's mean and variance by enumeration of its randomness
#
# All of them read one table per sequence, log_probs_under_every_mask (bgpo.py): logp[S, i] for
# every mask set S. a[S] = sum_{i in S} logp[S, i] over all 2^L bitmasks (a[0] = 0) is the only
# quantity the ELBO estimators see; the trajectory's states are mask sets too.


def _size_stats(a, L, free=None):
    """For k = 1..F: the mean and the population variance of a(S) over the k-subsets S of the free
    positions (all L if free is None)."""
    inside = subset_masks(L)
    size = inside.sum(1)
    ok = torch.ones(2**L, dtype=torch.bool) if free is None else ~(inside & ~free).any(1)
    F = L if free is None else int(free.sum())
    return [(a[ok & (size == k)].mean(), a[ok & (size == k)].var(unbiased=False)) for k in range(1, F + 1)]


def count_form_moments(stats):
    """One draw of X = (F/k) a(S), k ~ U{1..F}: (mean, variance). n independent draws: variance / n."""
    F = len(stats)
    mean = sum(F / k * m for k, (m, v) in enumerate(stats, 1)) / F
    second = sum((F / k) ** 2 * (v + m**2) for k, (m, v) in enumerate(stats, 1)) / F
    return mean, second - mean**2


def stratified_moments(stats, n_t):
    """draw_mc_samples' stratified scheme with n_t samples: k_0 ~ U{1..L} fixes the n_t counts,
    then the subsets are independent. Var = E_k0 Var(X | k_0) + Var_k0 E(X | k_0)."""
    L = len(stats)
    offsets = [round(j * L / n_t) for j in range(n_t)]
    cond_mean, cond_var = [], []
    for k0 in range(1, L + 1):
        ks = [(k0 - 1 + o) % L + 1 for o in offsets]
        cond_mean.append(sum(L / k * stats[k - 1][0] for k in ks) / n_t)
        cond_var.append(sum((L / k) ** 2 * stats[k - 1][1] for k in ks) / n_t**2)
    cond_mean = torch.stack(cond_mean)
    return cond_mean.mean(), torch.stack(cond_var).mean() + cond_mean.var(unbiased=False)


def antithetic_moments(a, L):
    """antithetic_elbo: P(S) = 1 / (L C(L, k)) for every non-empty S."""
    inside = subset_masks(L)
    k = inside.sum(1)[1:].to(a)
    S = torch.arange(1, 2**L)
    comp = (2**L - 1) ^ S
    x = torch.where(k == L, a[S], 0.5 * (L / k * a[S] + L / (L - k).clamp(min=1) * a[comp]))
    p = torch.tensor([1 / (L * math.comb(L, int(j))) for j in k]).to(a)
    mean = (p * x).sum()
    return mean, (p * x**2).sum() - mean**2


def diffucoder_moments(a, mean_field, L, nodes=64):
    """diffucoder_coupled: X(t, S) = 1/2 [MF + a(S)/t + a(S^c)/(1-t)], t ~ U(0.2, 0.8), P(S | t) =
    t^k (1-t)^(L-k). Exact over S; over t, Gauss-Legendre quadrature of the smooth integrand on
    [0.2, 0.8] (64 nodes: error far below float64 rounding of the sums)."""
    u, w = np.polynomial.legendre.leggauss(nodes)
    k = subset_masks(L).sum(1).to(a)
    comp = (2**L - 1) ^ torch.arange(2**L)
    mean = second = 0.0
    for t, wt in zip(0.5 + 0.3 * u, w / 2):                                          # U(0.2, 0.8) = 0.5 + 0.3 U(-1, 1)
        p = t**k * (1 - t) ** (L - k)
        x = 0.5 * (mean_field + a / t + a[comp] / (1 - t))
        mean, second = mean + wt * (p * x).sum(), second + wt * (p * x**2).sum()
    return mean, second - mean**2


def trajectory_moments(logp_full, commit_steps, block_len):
    """T(y) read off the table (the state before step s is the set {j: commit_j >= s}), and dTRPO's
    exact moments: its blocks are independent, so Var = sum_b K_b^2 Var_{t in b}(Delta_t)."""
    L = commit_steps.shape[0]
    bit = 1 << torch.arange(L)
    total, var = 0.0, 0.0
    for lo in range(0, L, block_len):
        in_block, deltas = torch.arange(L) // block_len == lo // block_len, []
        for s in commit_steps[in_block].unique():
            state = int(bit[commit_steps >= s].sum())
            deltas.append(logp_full[state][(commit_steps == s) & in_block].sum())
        deltas = torch.stack(deltas)
        total, var = total + deltas.sum(), var + len(deltas) ** 2 * deltas.var(unbiased=False)
    return total, var


def one_step_prompt_mask_moments(model, prompt, completions, p, chunk=1024, weights=None):
    """one_step_log_likelihood with prompt masking, exactly: every one of the 2^P prompt masks m,
    with P(m) = p^|m| (1-p)^(P-|m|). The G completions of one prompt share each forward pass (the
    completion is all MASK, so the input does not depend on it). Returns (G,) means and variances,
    or, given weights (G,), backpropagates sum_g weights_g E[X_g] instead (the exact gradient)."""
    P, (G, L) = prompt.shape[0], completions.shape
    masks = subset_masks(P).to(prompt.device)
    prob = (p ** masks.sum(1) * (1 - p) ** (P - masks.sum(1))).to(torch.get_default_dtype())
    mean = second = 0.0
    for m, pm in zip(masks.split(chunk), prob.split(chunk)):
        x = prompt.expand(len(m), P).masked_fill(m, model.config.mask_id)
        y_t = torch.full((len(m), L), model.config.mask_id, device=prompt.device)
        logp = model(torch.cat([x, y_t], 1))[:, P:].log_softmax(-1)                  # (n, L, V)
        vals = logp.gather(-1, completions.T[None].expand(len(m), L, G)).sum(1)       # (n, G)
        pm = pm.to(vals)
        if weights is not None:
            (pm @ vals @ weights).backward()
            continue
        vals = vals.detach()
        mean, second = mean + pm @ vals, second + pm @ vals**2
    return None if weights is not None else (mean, second - mean**2)


def exact_table(model, prompt, completion):
    """One sequence's enumeration, detached, in float64: masks (N, L) and logp (N, L) as in
    log_probs_under_every_mask, a (2^L,) = a(S) indexed by bitmask (a[0] = 0), and full (2^L, L) =
    logp indexed by bitmask (row 0 all zero)."""
    with torch.no_grad():
        masks, logp = log_probs_under_every_mask(model, prompt, completion)
    masks, logp = masks.cpu(), logp.double().cpu()
    full = torch.cat([logp.new_zeros(1, masks.shape[1]), logp])                       # row = bitmask
    return masks, logp, (full * subset_masks(masks.shape[1])).sum(1), full


def anchored_elbo(model, prompt, completion, free):
    """stp_log_likelihood's exact mean: sum over the non-empty subsets S of the F free positions of
    a(S) / (k C(F, k)), the ELBO of the free tokens with the anchors in the context. Differentiable."""
    positions = free.nonzero()[:, 0]
    F, L = len(positions), completion.shape[0]
    pick = subset_masks(F, completion.device)[1:]                                    # (2^F - 1, F)
    masks = torch.zeros(len(pick), L, dtype=torch.bool, device=completion.device)
    masks[:, positions] = pick
    logp = masked_log_likelihood(model, prompt.expand(len(masks), -1), completion.expand(len(masks), L), masks,
                                 per_token=True)
    return elbo_from_table(pick, logp[:, positions])                                 # the ELBO over F positions


# -----------------------------------------------------------------------------
# 3. The lab: python bgpo.py --bench-estimators

N_T = (1, 2, 4, 8, 16, 32, 64)
MAX_PROMPT_MASKED = 14                   # d1's prompt masking is enumerated up to 2^14 prompt masks
REPEATS = 8                              # recomputations per gradient, as in the paper's Fig. 3


def lab_batch(task):
    """A fixed batch of 4 prompts x G = 8 rollouts; 2 x 2 on Sudoku, whose 2^16 mask sets per
    sequence take about a minute each with the default model on 2 CPU cores."""
    return (4, 8) if task.gen_len <= 12 else (2, 2)


def _rollouts(model, task, prompts, args, seed, remasking="low_confidence"):
    G = lab_batch(task)[1]
    prompts = [p for p in prompts for _ in range(G)]
    x = encode(task, prompts, device=args.device)
    y, commit = generate(model, x, task.gen_len, steps=args.gen_steps, block_len=args.block_len, temperature=args.temperature,
                         generator=torch.Generator().manual_seed(seed), return_steps=True, remasking=remasking)
    rewards = torch.tensor([task.reward(p, task.decode(c)) for p, c in zip(prompts, y.cpu())])
    return x, y, commit, group_advantages(rewards, G).to(args.device), rewards


def _gradient(model, run, measure=False):
    """Runs one objective's forward and backward; returns the flat gradient and, if measure, the peak
    MB autograd held (ActivationMemory's hooks cost time, so only when asked)."""
    model.zero_grad(set_to_none=True)
    with ActivationMemory(model) if measure else contextlib.nullcontext() as memory:
        run()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]  # None: untouched
    return torch.cat([g.flatten() for g in grads]).double().cpu(), memory.peak / 2**20 if measure else None


def _surrogate(A, L, estimate):
    """On-policy, every objective of the family has the gradient of -mean_b A_b X_b / L, with X the
    method's log-likelihood estimate (for BGPO and the naive objective this is DESIGN.md sec. 4)."""
    return lambda: (-(A.to(torch.get_default_dtype()) * estimate()).mean() / L).backward()


def _cos(u, v):
    return float(u @ v / (u.norm() * v.norm()))


def _bgpo_run(model, x, y, A, n_t, generator, naive=False):
    """BGPO's on-policy update (or the naive objective's) with n_t stratified samples, for _gradient."""
    mc = draw_mc_samples(x.shape[0], y.shape[1], n_t, generator).to(x.device)
    with torch.no_grad():
        old = elbo_terms(model, x, y, mc)                                           # on-policy: old = current
    if naive:
        return lambda: naive_loss(model, x, y, mc, old, A).backward()
    return lambda: bgpo_backward(model, x, y, mc, old, A)


def _exact_elbo_run(model, x, y, A):
    """Backpropagates -sum_b A_b ELBO(y_b) / (B L) with the exact ELBO: BGPO's expected gradient."""
    B, L = y.shape

    def run():
        for b in (A != 0).nonzero()[:, 0].tolist():                                 # A = 0 adds nothing
            elbo = elbo_from_table(*log_probs_under_every_mask(model, x[b], y[b]))
            (-A[b].to(elbo) / (B * L) * elbo).backward()
    return run


def likelihood_table(model, x, y, commit, block_len, group, anchors=None, prompt_mask_prob=0.15):
    """Exact mean and variance of every estimator, per sequence; the two reference values (the ELBO and
    the log random-order likelihood); and the variance between mask counts of one count-form draw."""
    B, L = y.shape
    rows = {}
    def add(name, fwd, mean, var):                                                  # var: of one draw, or a function of n
        rows.setdefault(name, {"fwd": fwd, "mean": [], "var": []})
        rows[name]["mean"].append(float(mean))
        rows[name]["var"].append([float(var(n)) if callable(var) else float(var) / n for n in N_T])
    elbo, ro, between = [], [], []
    for b in range(B):
        masks, logp, a, full = exact_table(model, x[b], y[b])
        elbo.append(float(elbo_from_table(masks, logp)))
        ro.append(float(random_order_from_table(masks, logp)[1]))
        stats = _size_stats(a, L)
        between.append(float(torch.stack([L / k * m for k, (m, v) in enumerate(stats, 1)]).var(unbiased=False)))
        add("ELBO, iid 1/t", "n", elbo[-1], float("inf"))
        add("ELBO, stratified (BGPO)", "n", elbo[-1], lambda n: stratified_moments(stats, n)[1])
        add("antithetic pair (ours)", "2n", *antithetic_moments(a, L))
        mean_field = full[-1].sum()
        add("DiffuCoder coupled", "3n", *diffucoder_moments(a, mean_field, L))
        add("one-step, no prompt mask", "1", mean_field, 0.0)
        K = int(commit[b].max()) + 1
        add("trajectory, all steps", str(K), *trajectory_moments(full, commit[b].cpu(), L)[:1], 0.0)
        nb = math.ceil(L / block_len)
        add("dTRPO, 1 step per block", f"{nb}n" if nb > 1 else "n", *trajectory_moments(full, commit[b].cpu(), block_len))
        if anchors is not None:
            add("count form, no anchors", "n", *count_form_moments(stats))
            add("STP, anchors never masked", "n", *count_form_moments(_size_stats(a, L, ~anchors[b])))
    if x.shape[1] <= MAX_PROMPT_MASKED:                                             # 2^P prompt masks
        for b in range(0, B, group):                                                # a group shares its prompt
            with torch.no_grad():
                mean, var = one_step_prompt_mask_moments(model, x[b], y[b:b + group], prompt_mask_prob)
            for m, v in zip(mean.tolist(), var.tolist()):
                add(f"one-step, prompt mask {prompt_mask_prob} (d1)", "n", m, v)
    return elbo, ro, rows, between


def print_likelihood_table(elbo, ro, rows, between):
    print(f"\n1. Likelihood estimators, exact by enumeration ({len(elbo)} sequences; mean ELBO {np.mean(elbo):.3f} nats,"
          f" mean log random-order likelihood {np.mean(ro):.3f})")
    print("n = independent draws (pairs for the antithetic estimator); fwd = forward passes per sequence;"
          " sd = root mean variance over sequences")
    print(f"{'estimator':<30} {'bias vs ELBO':>12} {'vs log p_RO':>11} {'fwd':>5} | sd at n = "
          + " ".join(f"{n:>6}" for n in N_T))
    for name, r in rows.items():
        bias = np.mean(r["mean"]) - np.mean(elbo)
        bias_ro = np.mean(r["mean"]) - np.mean(ro)
        sd = np.sqrt(np.mean(r["var"], 0)) if "n" in r["fwd"] else np.sqrt(np.mean(r["var"], 0))[:1]
        print(f"{name:<30} {bias:>+12.3f} {bias_ro:>+11.3f} {r['fwd']:>5} |" + " " * 11
              + " ".join(f"{s:>6.3f}" if np.isfinite(s) else f"{'inf':>6}" for s in sd))
    one_draw = np.mean([v[0] for v in rows["ELBO, stratified (BGPO)"]["var"]])
    print(f"Of one count-form draw's variance ({one_draw:.2f} nats^2, mean over sequences), {np.mean(between):.2f} is"
          " between mask counts (the spread of the L/k-weighted means), which stratification removes.")


def gradient_table(model, x, y, commit, A, block_len, group, anchors=None, prompt_mask_prob=0.15):
    """The Fig. 3 analogue, on-policy with fixed advantages: for each objective and n_t, REPEATS
    gradients with fresh draws, compared with the objective's own exact expected gradient and with
    the exact ELBO gradient."""
    B, L = y.shape
    live = (A != 0).nonzero()[:, 0].tolist()                                        # A = 0 adds nothing
    scale = -A.to(torch.get_default_dtype()) / (B * L)

    def own_one_step():
        for b in range(0, B, group):
            one_step_prompt_mask_moments(model, x[b], y[b:b + group], prompt_mask_prob, weights=scale[b:b + group])

    def own_stp():
        for b in live:
            (scale[b] * anchored_elbo(model, x[b], y[b], ~anchors[b])).backward()

    objectives = {}  # name -> (run for n draws and a generator, own exact expected gradient's run)
    if anchors is None:                                                             # 2^L mask sets per sequence
        golden = _exact_elbo_run(model, x, y, A)
        objectives["BGPO = naive (ELBO)"] = (lambda n, g: _bgpo_run(model, x, y, A, n, g), golden)
        if x.shape[1] <= MAX_PROMPT_MASKED:
            objectives[f"diffu-GRPO (p = {prompt_mask_prob})"] = (lambda n, g: _surrogate(A, L, lambda: average_of_draws(
                one_step_log_likelihood, n, model, x, y, prompt_mask_prob=prompt_mask_prob, generator=g)), own_one_step)
    else:
        golden = None
        objectives["STP (anchored ELBO)"] = (lambda n, g: _surrogate(A, L, lambda: average_of_draws(
            stp_log_likelihood, n, model, x, y, anchors, generator=g)), own_stp)
    objectives["dTRPO (1 step per block)"] = (lambda n, g: _surrogate(A, L, lambda: average_of_draws(
        dtrpo_log_likelihood, n, model, x, y, commit, block_len=block_len, generator=g)),
        _surrogate(A, L, lambda: trajectory_log_likelihood(model, x, y, commit)))

    g_elbo = _gradient(model, golden)[0] if golden else None
    results = {}
    for name, (run, own) in objectives.items():
        g_own = g_elbo if own is golden else _gradient(model, own)[0]
        rows = []
        for n in N_T:
            draws = [_gradient(model, run(n, torch.Generator().manual_seed(1000 * n + r)), measure=r == 0)
                     for r in range(REPEATS)]
            G = torch.stack([d[0] for d in draws])                                  # (REPEATS, parameters)
            std, norm = G.std(0), g_own.norm()
            row = {"n_t": n, "std": float(std.mean()), "act_mb": draws[0][1],
                   "rel_single": float(np.mean([float((g - g_own).norm() / norm) for g in G])),
                   "rel_mean": float((G.mean(0) - g_own).norm() / norm),
                   "floor": float(std.square().sum().sqrt() / math.sqrt(REPEATS) / norm),
                   "cos": float(np.mean([_cos(g, g_own) for g in G]))}
            if g_elbo is not None:
                row["rel_mean_elbo"] = float((G.mean(0) - g_elbo).norm() / g_elbo.norm())
            if name.startswith("BGPO"):
                naive = _bgpo_run(model, x, y, A, n, torch.Generator().manual_seed(n), naive=True)
                row["naive_act_mb"] = _gradient(model, naive, measure=True)[1]
            rows.append(row)
        results[name] = {"rows": rows, "own_vs_elbo": None if g_elbo is None else
                         float((g_own - g_elbo).norm() / g_elbo.norm())}
        print_gradient_rows(name, results[name])
    return results, g_elbo


def print_gradient_rows(name, r):
    head = f"{name}: golden = its own exact expected gradient"
    if r["own_vs_elbo"] is not None:
        head += f", which is {r['own_vs_elbo']:.3f} (relative) from the exact ELBO gradient"
    print(head)
    naive = "naive MB" if "naive_act_mb" in r["rows"][0] else ""
    print(f"  {'n_t':>4} {'mean std':>10} {'rel. 1 draw':>11} {'rel. mean of 8':>14} {'floor':>7} {'cos':>6}"
          f" {'vs ELBO':>8} {'act MB':>8} {naive:>9}")
    for row in r["rows"]:
        line = (f"  {row['n_t']:>4} {row['std']:>10.2e} {row['rel_single']:>11.3f} {row['rel_mean']:>14.3f}"
                f" {row['floor']:>7.3f} {row['cos']:>6.3f} {row.get('rel_mean_elbo', float('nan')):>8.3f}"
                f" {row['act_mb']:>8.1f}")
        if "naive_act_mb" in row:
            line += f" {row['naive_act_mb']:>9.1f}" + (" <- naive holds more" if row["naive_act_mb"] > 1.01 * row["act_mb"] else "")
        print(line)


def signal_to_noise(model, task, prompts, args, batch1, exact1):
    """Is RL limited by MC noise or by rollout noise? Cosines between BGPO gradients: two MC draws on
    the same rollouts, and two independent rollout batches of the same prompts; n_t = inf is exact."""
    batch2 = _rollouts(model, task, prompts, args, seed=args.seed + 7)

    def grad(batch, n, seed):
        x, y, _, A, _ = batch
        return _gradient(model, _bgpo_run(model, x, y, A, n, torch.Generator().manual_seed(seed)))[0]

    rows = []
    for n in N_T[::2]:                                                              # 1, 4, 16, 64
        pairs = max(2, N_T[-1] // n)                                                # about the same cost for every n_t
        same = [_cos(grad(batch1, n, 10 * r), grad(batch1, n, 10 * r + 1)) for r in range(pairs)]
        other = [_cos(grad(batch1, n, 10 * r + 2), grad(batch2, n, 10 * r + 3)) for r in range(pairs)]
        rows.append({"n_t": n, "pairs": pairs, "cos_mc": float(np.mean(same)), "cos_rollouts": float(np.mean(other))})
    x, y, _, A, _ = batch2
    exact2 = _gradient(model, _exact_elbo_run(model, x, y, A))[0]
    rows.append({"n_t": "inf", "cos_mc": 1.0, "cos_rollouts": _cos(exact1, exact2)})
    print("\n3. Signal to noise of the RL gradient (BGPO; mean cosine over pairs of gradients)")
    print(f"  {'n_t':>4} {'pairs':>5} {'two MC draws, same rollouts':>28} {'two rollout batches, same prompts':>34}")
    for row in rows:
        print(f"  {row['n_t']:>4} {row.get('pairs', ''):>5} {row['cos_mc']:>28.3f} {row['cos_rollouts']:>34.3f}")
    return rows


def policy_gradient_check(model, task, prompts, args):
    """Is the ELBO the right thing to push? With random remasking and one token per step, the sampler
    IS the random-order model, so its exact log-likelihood log pi(y) = log E_sigma p_sigma(y) is
    known (random_order_from_table) and sum_b A_b grad log pi(y_b) is the exact policy gradient on a
    batch of its rollouts. Compared with the exact ELBO gradient and the trajectory-sum gradient
    (REINFORCE on the sampled order: unbiased for the same expected-reward gradient, but noisier).
    On the first two prompts of the lab's batch: two backward passes through 2^L rows per sequence."""
    x, y, commit, A, rewards = _rollouts(model, task, prompts[:2], args, seed=args.seed + 11, remasking="random")
    B, L = y.shape
    scale = -A.to(torch.get_default_dtype()) / (B * L)

    params = list(model.parameters())
    g_pi, g_elbo = (torch.zeros(sum(p.numel() for p in params), dtype=torch.float64) for _ in range(2))
    for b in (A != 0).nonzero()[:, 0].tolist():                                     # one table, two gradients
        table = log_probs_under_every_mask(model, x[b], y[b])
        for g, value in ((g_pi, random_order_from_table(*table)[1]), (g_elbo, elbo_from_table(*table))):
            grads = torch.autograd.grad(scale[b] * value, params, retain_graph=True, allow_unused=True)
            g += torch.cat([(torch.zeros_like(p) if d is None else d).flatten() for p, d in zip(params, grads)]).double().cpu()
    g_traj = _gradient(model, _surrogate(A, L, lambda: trajectory_log_likelihood(model, x, y, commit)))[0]
    bgpo = [_gradient(model, _bgpo_run(model, x, y, A, 16, torch.Generator().manual_seed(r)))[0] for r in range(4)]
    rows = {"exact ELBO gradient": g_elbo, "BGPO, n_t = 16 (one draw, mean of 4)": None,
            "trajectory sum (REINFORCE on the order)": g_traj}
    print(f"\n4. The ELBO as a policy gradient: random-remasking rollouts (mean reward {rewards.mean():.3f}), whose exact"
          " log-likelihood is the random-order one")
    print(f"  {'gradient':<42} {'cosine with the exact policy gradient':>38} {'norm ratio':>11}")
    result = {}
    for name, g in rows.items():
        cos = np.mean([_cos(d, g_pi) for d in bgpo]) if g is None else _cos(g, g_pi)
        ratio = np.mean([float(d.norm() / g_pi.norm()) for d in bgpo]) if g is None else float(g.norm() / g_pi.norm())
        result[name] = {"cos": float(cos), "norm_ratio": ratio}
        print(f"  {name:<42} {cos:>38.3f} {ratio:>11.3f}")
    return result


def estimators_figure(results):
    """The paper's Fig. 3 in small: the gradient's std and the distance of the 8-draw mean from the
    exact ELBO gradient (its "bias"), against n_t, one line per objective; data for bgpo.draw."""
    panels = [{"title": "gradient std (mean over parameters)", "key": "std"},
              {"title": "distance of the 8-draw mean from the\nexact ELBO gradient (relative L2)", "key": "rel_mean_elbo"}]
    for panel in panels:
        key = panel.pop("key")
        panel.update(xlabel="n_t", xscale="log", yscale="log", lines=[
            {"label": name, "x": [row["n_t"] for row in r["rows"]], "y": [row[key] for row in r["rows"]], "style": "o-"}
            for name, r in results.items() if key in r["rows"][0]])
    return {"panels": [p for p in panels if p["lines"]]}


def bench_estimators(args, task, model):
    """Every estimator on one fixed batch of the SFT model's own rollouts: four tables (the last two on
    Countdown and arithmetic only), a JSON file, and with --plot the Fig. 3 PNG."""
    t0 = time.time()
    n_prompts, G = lab_batch(task)
    prompts, _ = task.sample(n_prompts, "train", args.seed + 3)
    batch = _rollouts(model, task, prompts, args, seed=args.seed + 5)
    x, y, commit, A, rewards = batch
    block_len = args.block_len or task.gen_len
    anchors = sudoku_anchors([p for p in prompts for _ in range(G)]).to(x.device) if task.name == "sudoku" else None
    if not (A != 0).any():
        raise RunError(f"every group's rollouts got equal rewards (mean {rewards.mean():.3f}): no gradient to measure; "
                       "try another --seed")
    print(f"{n_prompts} prompts x G = {G} rollouts of the SFT model on {task.name} (L = {task.gen_len}, temperature "
          f"{args.temperature}): mean reward {rewards.mean():.3f}, {int((A != 0).sum())} sequences with A != 0")
    elbo, ro, rows, between = likelihood_table(model, x, y, commit, block_len, G, anchors)
    print_likelihood_table(elbo, ro, rows, between)
    print(f"({time.time() - t0:.0f} s)")
    if anchors is not None:
        stp = np.array(rows["STP, anchors never masked"]["var"])[:, 0]
        plain = np.array(rows["count form, no anchors"]["var"])[:, 0]
        print(f"STP's variance claim: Var(anchored) < Var(no anchors) for {int((stp < plain).sum())} of {len(stp)} "
              f"sequences; mean ratio {np.mean(stp / plain):.3f}")
    print(f"\n2. Gradient of the RL objective, on-policy, fixed advantages ({REPEATS} recomputations per row; relative"
          " distances are L2 norms divided by the golden gradient's)")
    results, g_elbo = gradient_table(model, x, y, commit, A, block_len, G, anchors)
    print(f"({time.time() - t0:.0f} s)")
    snr = signal_to_noise(model, task, prompts, args, batch, g_elbo) if anchors is None else None
    policy = policy_gradient_check(model, task, prompts, args) if anchors is None else None
    path = os.path.join(args.out_dir, f"estimators_{task.name}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"task": task.name, "elbo": elbo, "random_order": ro, "likelihood": rows, "between_mask_counts": between,
                   "gradient": results, "signal_to_noise": snr, "policy_gradient": policy}, f, indent=1)
    print(f"\nwrote {path} ({time.time() - t0:.0f} s, SFT excluded)")
    if args.plot:
        draw(estimators_figure(results), os.path.join(args.out_dir, f"estimators_{task.name}.png"))


# -----------------------------------------------------------------------------
# 4. The field's RL objectives: python bgpo.py --objective diffu-grpo | stp | dtrpo
#
# Each method fixes its randomness once per rollout batch, one draw per inner update (a prompt mask,
# n masked copies, one step per block), and computes the rollout policy's values on those draws
# (field_rollout); inner update j then compares the current policy with the old one on draw j, as
# d1 does with its mask seeds. On-policy every loss has the gradient of -mean_b A_b X_b / L, with X
# the method's estimate of log pi(y_b | x), the same as BGPO's with the ELBO (DESIGN.md sec. 4).


def token_grpo_loss(logp, old_logp, advantages, clip_eps=None):
    """d1's per-token GRPO: -(1/BL) sum_{b,i} min(rho_bi A_b, clip(rho_bi, 1 - eps, 1 + eps) A_b), with
    rho_bi = exp(logp_bi - old_logp_bi); logp, old_logp (B, L), advantages (B,); clip_eps None: no clip."""
    if logp.dim() != 2 or tuple(old_logp.shape) != tuple(logp.shape):
        raise ValueError(f"old_logp: expected {tuple(logp.shape)}, got {tuple(old_logp.shape)}")
    if tuple(advantages.shape) != (logp.shape[0],):
        raise ValueError(f"advantages: expected ({logp.shape[0]},), got {tuple(advantages.shape)}")
    return -_ppo((logp - old_logp).exp(), advantages.to(logp)[:, None], clip_eps).mean()


def diffu_grpo_loss(model, prompts, completions, prompt_mask, old_logp, advantages, clip_eps=0.5):
    """d1's diffu-GRPO (Zhao et al. 2025), one inner update: token_grpo_loss on the one-step mean-field
    estimate of each token, log p(y^i | x~, completion all MASK), where x~ is the prompt masked at
    prompt_mask (B, P) bool, the same mask for the old and the current policy. old_logp (B, L).
    Departures from d1: 1. group_advantages (z-scored) by default; d1 divides by nothing
    (d1_advantages, bgpo.py --d1-advantages, restores it). 2. No KL term (d1: beta 0.04). 3. mu = 4 inner
    updates by default (d1: 12). 4. Every completion position counts (d1 stops at the first EOS)."""
    if tuple(prompt_mask.shape) != tuple(prompts.shape):
        raise ValueError(f"prompt_mask: expected {tuple(prompts.shape)}, got {tuple(prompt_mask.shape)}")
    x = prompts.masked_fill(prompt_mask.to(prompts.device), model.config.mask_id)
    logp = one_step_log_likelihood(model, x, completions, per_token=True)
    return token_grpo_loss(logp, old_logp, advantages, clip_eps)


def stp_loss(model, prompts, completions, mc, old_logp, advantages, clip_eps=0.2):
    """STP (Liu et al. 2026), one inner update: token_grpo_loss on stp_token_log_likelihood, the per-
    token split of the anchored ELBO over mc's n copies (draw_anchored_masks: anchors never masked).
    The rollouts come from generate(..., prior=, early_stop=): anchors pre-filled, early stop.
    Departures from STP: 1. per-token terms weighted F/k and from masked positions only (STP's code:
    an unweighted mean over copies, visible positions included). 2. Anchors are Sudoku's given cells,
    not the most confident tokens of an offline LLaDA completion; Countdown and arithmetic have none,
    so there STP is temporal pruning only. 3. The early stop counts tokens in place, tau = 0.75 by
    default (STP: 0.95 of 256 tokens; 0.95 of 10 tokens would be the last token only). 4. No KL
    term (STP: beta 0.04). 5. group_advantages, not STP's (r - mean) / (std + 1e-4)."""
    return token_grpo_loss(stp_token_log_likelihood(model, prompts, completions, mc), old_logp, advantages, clip_eps)


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
    return -_ppo(ratio, advantages.to(ratio), clip_eps).mean()


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


FIELD = ("diffu-grpo", "stp", "dtrpo")


def d1_advantages(rewards, group_size):
    """d1's advantage: the reward minus its group's mean, not divided by the group's std."""
    r = reward_groups(rewards, group_size)
    return (r - r.mean(1, keepdim=True)).flatten()


def stp_prior(task, prompts, mask_id):
    """STP's static prior as generate's prior=: (B, L) token ids, mask_id at the free positions. On
    Sudoku, the given cells (the completion repeats the grid); the other tasks have none: None."""
    if task.name != "sudoku":
        return None
    grid = task.tokenizer.encode_batch([p.replace("|", "") for p in prompts], task.gen_len, "right")
    return grid.masked_fill(~sudoku_anchors(prompts), mask_id)


@torch.no_grad()
def field_rollout(model, objective, x, y, commit_steps, inner, generator, anchors=None, num_t=3, block_len=None,
                  prompt_mask_prob=0.15):
    """What a field objective fixes once per rollout batch: for each of the `inner` updates its own
    draw (diffu-GRPO: a prompt mask; STP: num_t anchored masked copies; dTRPO: one step per block)
    and the rollout policy's values on it ("old"). Every tensor is (B, inner, ...): a part of the
    batch is a set of rows, and inner update j reads [:, j]."""
    B, L = y.shape
    if objective == "diffu-grpo":
        hide = (torch.rand(B, inner, x.shape[1], generator=generator) < prompt_mask_prob).to(x.device)
        old = [one_step_log_likelihood(model, x.masked_fill(hide[:, j], model.config.mask_id), y, per_token=True)
               for j in range(inner)]
        return {"prompt_mask": hide, "old": torch.stack(old, 1)}
    if objective == "stp":
        anchors = torch.zeros(B, L, dtype=torch.bool) if anchors is None else anchors
        mc = draw_anchored_masks(anchors, inner * num_t, generator)
        mc = MCSamples(mc.mask.view(B, inner, num_t, L), mc.weight.view(B, inner, num_t)).to(x.device)
        return {"mc": mc, "old": torch.stack([stp_token_log_likelihood(model, x, y, mc[j]) for j in range(inner)], 1)}
    if objective == "dtrpo":
        t = torch.stack([draw_block_steps(commit_steps, block_len, generator) for _ in range(inner)], 1)
        old = [dtrpo_log_likelihood(model, x, y, commit_steps, block_len, steps=t[:, j]) for j in range(inner)]
        return {"commit_steps": commit_steps, "steps": t, "old": torch.stack(old, 1)}
    raise ValueError(f"objective: expected one of {FIELD}, got {objective!r}")


def field_loss(model, objective, x, y, rollout, advantages, j, clip_eps=None, block_len=None):
    """The loss of inner update j for these rows (rollout from field_rollout, maybe a part of it)."""
    old = rollout["old"][:, j]
    if objective == "diffu-grpo":
        return diffu_grpo_loss(model, x, y, rollout["prompt_mask"][:, j], old, advantages, clip_eps)
    if objective == "stp":
        return stp_loss(model, x, y, rollout["mc"][j], old, advantages, clip_eps)
    if objective == "dtrpo":
        return dtrpo_loss(model, x, y, rollout["commit_steps"], rollout["steps"][:, j], old, advantages, clip_eps,
                          block_len)
    raise ValueError(f"objective: expected one of {FIELD}, got {objective!r}")


def every_objective_table(measure, L, cuda):
    """--bench-memory's second table: one update of every objective on the same batch, at its sample
    count; measure(objective, n) -> (activation MB, seconds, CUDA MB) is bench_memory's."""
    print("\nEvery objective, one update on the same batch: which grow with their sample count")
    print(f"{'objective':>10} | {'samples':>22} | {'act MB':>8} | {'s':>7}" + (f" | {'CUDA MB':>8}" if cuda else ""))
    for objective, what, counts in (("bgpo", "n_t masked copies", (1, 16)), ("naive", "n_t masked copies", (1, 16)),
                                    ("stp", "num_t masked copies", (1, 3, 16)), ("diffu-grpo", "1 prompt mask", (1,)),
                                    ("dtrpo", "1 step per block", (1,)), ("trajectory", f"all {L} steps", (1,))):
        for n in counts:
            mb, s, cuda_mb = measure(objective, n)
            label = what if len(counts) == 1 else f"{n} {what}"
            print(f"{objective:>10} | {label:>22} | {mb:>8.1f} | {s:>7.3f}" + (f" | {cuda_mb:>8.1f}" if cuda else ""))


def offline_dtrpo(args, task, model, n_prompts=512, epochs=4, batch=32, beta=0.1, lr=5e-5):
    """dTRPO as published, in small (python bgpo.py --dtrpo-offline): the SFT model samples G
    completions of n_prompts training problems, recording their commit steps; each group gives
    min(#solved, #not solved) pairs of a solved (reward 1) and an unsolved completion; dtrpo_dpo_loss
    trains the model on them against the frozen SFT model. Each epoch prints the exact trajectory
    margin on the pairs (every step, trajectory_log_likelihood), the quantity the one-step-per-block
    estimate stands for, and the held-out accuracy."""
    g = torch.Generator().manual_seed(args.seed + 4)
    eval_prompts = task.sample(args.eval_size, "test", 1234)[0]
    prompts = [p for p in task.sample(n_prompts, "train", g)[0] for _ in range(args.group_size)]
    x = encode(task, prompts, device=args.device)
    model.eval()
    y, commit = generate(model, x, task.gen_len, steps=args.gen_steps, block_len=args.block_len,
                         temperature=args.temperature, generator=g, return_steps=True)
    solved = torch.tensor([task.reward(p, task.decode(c)) == 1.0 for p, c in zip(prompts, y.cpu())])
    win, lose = [], []
    for lo in range(0, len(prompts), args.group_size):                              # pairs within a prompt's group
        group = torch.arange(lo, lo + args.group_size)
        w, l = group[solved[group]], group[~solved[group]]
        win, lose = win + w[:len(l)].tolist(), lose + l[:len(w)].tolist()
    win, lose = torch.tensor(win), torch.tensor(lose)
    reference = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def shifts():  # mean exact log-ratio to the reference, T_theta - T_ref, of the solved and the unsolved
        return [float((trajectory_log_likelihood(model, x[i], y[i], commit[i]) -
                       trajectory_log_likelihood(reference, x[i], y[i], commit[i])).mean()) for i in (win, lose)]

    with torch.no_grad():  # what one step per block sees of the margin log p(w) - log p(l), against all steps
        exact = trajectory_log_likelihood(model, x[win], y[win], commit[win]) - \
            trajectory_log_likelihood(model, x[lose], y[lose], commit[lose])
        one = dtrpo_log_likelihood(model, x[win], y[win], commit[win], args.block_len, g) - \
            dtrpo_log_likelihood(model, x[lose], y[lose], commit[lose], args.block_len, g)
    result = {"pairs": len(win), "accuracy": [evaluate(model, task, eval_prompts, args, n_show=0)["accuracy"]],
              "margin": exact.mean().item(), "margin_sd": exact.std().item(), "estimate_sd": (one - exact).std().item()}
    print(f"{len(win)} pairs from {n_prompts} prompts x G = {args.group_size} (solved share {solved.float().mean():.3f});"
          f" held-out accuracy of the SFT model {result['accuracy'][0]:.1%}")
    print(f"log-likelihood margin of the pairs, solved - unsolved (all steps): mean {result['margin']:+.2f}, sd"
          f" {result['margin_sd']:.2f} nats; one step per block misses it by {result['estimate_sd']:.2f} nats (sd)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(win), generator=g)
        for i in range(0, len(win), batch):
            w, l = win[order[i:i + batch]], lose[order[i:i + batch]]
            loss = dtrpo_dpo_loss(model, reference, x[w], y[w], commit[w], y[l], commit[l], beta, args.block_len,
                                  generator=g)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        (up, down), accuracy = shifts(), evaluate(model, task, eval_prompts, args, n_show=0)["accuracy"]
        result["accuracy"].append(accuracy)
        print(f"epoch {epoch + 1}: exact log-ratio to the SFT model, solved {up:+.3f}, unsolved {down:+.3f} (margin"
              f" {up - down:+.3f}); held-out accuracy {accuracy:.1%}")
    return result
