"""
The other ways the field estimates a dLLM's log-likelihood, each with its exact mean and variance.

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
by enumerating its randomness (mask sets, steps, prompt masks) with their probabilities: section 3,
on the exact likelihoods of section 2 (the ELBO, and the random-order model's likelihood by a dynamic
programme over the 2^L mask sets, both from one table of every mask set's log-probabilities).
lab/bench_estimators.py measures them all on a trained model; lab/objectives.py makes RL objectives
of them.

Where the toy versions depart from their papers:
1. DiffuCoder draws one mask ratio t for the whole batch; here each sequence draws its own, so
   sequences are independent draws.
2. d1 masks every prompt position with probability 0.15, padding included; so does
   one_step_log_likelihood.
3. dTRPO uses block attention to fit all of a sequence's sampled states into one row; with full
   attention we use one row per block, all blocks in one batched forward. The step of a block is
   drawn among the steps that committed at least one of its tokens (a step that commits nothing adds
   0 to the sum, so the estimate stays unbiased, with a smaller scale and variance).
4. STP: the count-form ELBO restricted to the free positions (weight F/k), not the STP code's
   unweighted per-token mean over masked copies; the anchors are Sudoku's given cells, not the
   highest-confidence tokens of an offline LLaDA completion. Temporal pruning (early stop) changes
   rollouts, not the estimator: it is lab.sampler.generate's early_stop.

Shapes: B batch, L completion length, P prompt length, K sampler steps, N enumerated sets.
"""
import math

import numpy as np
import torch

from bgpo import MCSamples
from tiny_dllm import mask_by_count, masked_log_likelihood

# -----------------------------------------------------------------------------
# 1. The estimators: each returns one value per sequence, (B,), in nats, with gradients


def _check_batch(prompts, completions):
    if prompts.dim() != 2 or completions.dim() != 2 or prompts.shape[0] != completions.shape[0]:
        raise ValueError(f"prompts, completions: expected (B, P) and (B, L), got {tuple(prompts.shape)} and "
                         f"{tuple(completions.shape)}")


def token_log_probs(model, prompts, completions, mask):
    """log p_theta(y^i | y_t, x) of every position, masked or not: (N, L). prompts (N, P), completions
    (N, L), mask (N, L) bool, the positions of y_t that are MASK. A copy of tiny_dllm.masked_log_likelihood
    without its final sum over the masked positions (a test keeps the two equal)."""
    P = prompts.shape[1]
    y_t = completions.masked_fill(mask, model.config.mask_id)
    logits = model(torch.cat([prompts, y_t], dim=1))[:, P:]             # (N, L, V)
    return logits.log_softmax(-1).gather(-1, completions[..., None])[..., 0]  # (N, L)


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
    logp = token_log_probs(model, prompts.repeat(3, 1), completions.repeat(3, 1), masks)
    logp, S, t = logp.view(3, B, L), S.to(logp.device), t.to(logp)
    l = 0.5 * (logp[0] + S * logp[1] / t + ~S * logp[2] / (1 - t))                  # (B, L)
    return l if per_token else l.sum(1)


def one_step_log_likelihood(model, prompts, completions, prompt_mask_prob=0.0, generator=None,
                            per_token=False):
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
    logp = token_log_probs(model, prompts, completions, everything)   # (B, L)
    return logp if per_token else logp.sum(1)


def check_commit_steps(prompts, completions, commit_steps):
    _check_batch(prompts, completions)
    if tuple(commit_steps.shape) != tuple(completions.shape):
        raise ValueError(f"commit_steps: expected {tuple(completions.shape)}, "
                         f"got {tuple(commit_steps.shape)}")
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
    check_commit_steps(prompts, completions, commit_steps)
    B, L = completions.shape
    K = int(commit_steps.max()) + 1
    s = torch.arange(K, device=commit_steps.device)[None, :, None]
    masked_before = commit_steps[:, None, :] >= s                                    # (B, K, L)
    logp = token_log_probs(model, prompts.repeat_interleave(K, 0), completions.repeat_interleave(K, 0),
                           masked_before.flatten(0, 1)).view(B, K, L)
    # each token at its own step
    per_position = (logp * (commit_steps[:, None, :] == s)).sum(1)
    return per_position if per_token else per_position.sum(1)


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


def dtrpo_log_likelihood(model, prompts, completions, commit_steps, block_len=None, generator=None,
                         steps=None):
    """dTRPO's estimate of T(y) (trajectory_log_likelihood): in each block b, one step t_b drawn
    uniformly among the K_b steps that committed the block's tokens (draw_block_steps, or given as
    steps (B, nb)), scaled by K_b:
        X = sum_b K_b sum_{i in b: commit_i = t_b} log p(y^i | y with {j: commit_j >= t_b} masked, x).
    E_{t_b}[K_b Delta_{t_b}] = sum_{t in block b} Delta_t, so E[X] = T(y): unbiased for the trajectory
    sum, with one forward pass per block instead of one per step (all blocks in one batch)."""
    check_commit_steps(prompts, completions, commit_steps)
    (B, L), block_len = completions.shape, block_len or completions.shape[1]
    present = _steps_of_blocks(commit_steps, block_len)                               # (B, nb, K)
    t = (draw_block_steps(commit_steps, block_len, generator) if steps is None
         else steps.to(commit_steps.device))
    if tuple(t.shape) != tuple(present.shape[:2]):
        raise ValueError(f"steps: expected {tuple(present.shape[:2])} (one step per block), "
                         f"got {tuple(t.shape)}")
    nb = t.shape[1]
    block = torch.arange(L, device=commit_steps.device) // block_len                 # (L,)
    # (B, nb, L): before step t_b
    states = commit_steps[:, None] >= t[..., None]
    new = (commit_steps[:, None] == t[..., None]) & (block == torch.arange(nb, device=block.device)[:, None])
    logp = token_log_probs(model, prompts.repeat_interleave(nb, 0), completions.repeat_interleave(nb, 0),
                           states.flatten(0, 1)).view(B, nb, L)
    return (present.sum(-1).to(logp) * (logp * new).sum(-1)).sum(1)


def draw_anchored_masks(anchors, n=1, generator=None):
    """STP's spatial pruning as a draw: n masked copies per sequence in which the anchors (B, L) bool
    are never masked. With F free positions, each copy draws k ~ U{1..F} and a uniform k-subset S of
    the free positions. Returns MCSamples: mask (B, n, L) and weight F/k (B, n)."""
    if anchors.dim() != 2 or anchors.dtype != torch.bool:
        raise ValueError("anchors: expected a (B, L) bool tensor, "
                         f"got {tuple(anchors.shape)} {anchors.dtype}")
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
    logp = token_log_probs(model, prompts.repeat_interleave(n, 0), completions.repeat_interleave(n, 0),
                           mask.flatten(0, 1)).view(B, n, L)
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
    return stp_token_log_likelihood(model, prompts, completions,
                                    draw_anchored_masks(anchors, 1, generator)).sum(1)


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
# 2. Exact likelihoods by enumeration of the 2^L mask sets (L <= 10 in seconds on a CPU)


def subset_masks(L, device=None):
    """Every subset of L positions as a (2^L, L) bool row: row S is the subset with bitmask S."""
    bits = torch.arange(2**L, device=device)
    return (bits[:, None] >> torch.arange(L, device=device)) & 1 == 1


def log_probs_under_every_mask(model, prompt, completion, chunk=1024):
    """The table behind every exact quantity, for one prompt (P,) and completion (L,): masks (N, L),
    every non-empty subset S of the positions (row r is bitmask r + 1, N = 2^L - 1), and logp (N, L)
    with logp[S, i] = log p(y^i | y with S masked, x). Differentiable; chunk bounds the rows per forward."""
    L = completion.shape[0]
    masks = subset_masks(L, completion.device)[1:]                                   # (N, L)
    rows = [token_log_probs(model, prompt.expand(len(m), -1), completion.expand(len(m), L), m)
            for m in masks.split(chunk)]
    return masks, torch.cat(rows)


def exact_elbo(model, prompt, completion):
    """The ELBO by enumerating the 2^L - 1 mask sets:
    ELBO = sum_{k=1..L} (1/k) mean_{|S|=k} sum_{i in S} log p(y^i | y with S masked, x).
    Both MC schemes have this expectation. Differentiable."""
    return elbo_from_table(*log_probs_under_every_mask(model, prompt, completion))


def elbo_from_table(masks, logp):
    """sum_S a(S) / (k C(L, k)), with a(S) the masked log-likelihood of set S and k = |S|."""
    L, k = masks.shape[1], masks.sum(1)
    n_sets = torch.tensor([math.comb(L, int(j)) for j in k], dtype=logp.dtype, device=logp.device)
    return ((logp * masks).sum(1) / (k * n_sets)).sum()


def random_order_log_likelihood(model, prompt, completion):
    """An any-order autoregressive model that reveals y one uniformly random position at a time:
    returns (E_sigma log p_sigma(y), log E_sigma p_sigma(y)). The first equals the ELBO (RADD's
    theorem), the second bounds it from above (Jensen). A dynamic programme over the 2^L sets S of
    still-masked positions gives both without the L! orders: f(empty) = h(empty) = 0,
        f(S) = (1/|S|) sum_{i in S} [log p(y^i | S masked) + f(S - i)]
        h(S) = log (1/|S|) sum_{i in S} exp(log p(y^i | S masked) + h(S - i)).  Differentiable."""
    return random_order_from_table(*log_probs_under_every_mask(model, prompt, completion))


def random_order_from_table(masks, logp):
    """random_order_log_likelihood's dynamic programme on the table of log_probs_under_every_mask."""
    L = masks.shape[1]
    size, bit = masks.sum(1), 1 << torch.arange(L, device=masks.device)
    f = h = logp.new_zeros(2**L)                                     # indexed by bitmask; f[0] = 0
    for k in range(1, L + 1):
        rows = (size == k).nonzero()[:, 0]                           # the sets of size k
        S = rows + 1
        child = S[:, None] & ~bit                                    # S - i for each i (S if i not in S)
        inside = masks[rows]
        f = f.index_put((S,), ((logp[rows] + f[child]) * inside).sum(1) / k)
        h_of_S = (logp[rows] + h[child]).masked_fill(~inside, float("-inf")).logsumexp(1) - math.log(k)
        h = h.index_put((S,), h_of_S)
    return f[-1], h[-1]


def spg_upper_bound(model, prompt, completion, beta):
    """SPG's upper bound (lab.objectives.spg_eubo, summed over the positions) in expectation over its
    copies, exactly: spg_bound_from_table on log_probs_under_every_mask. Differentiable."""
    return spg_bound_from_table(*log_probs_under_every_mask(model, prompt, completion), beta)


def spg_bound_from_table(masks, logp, beta):
    """(1/beta) sum_i log E_S[w 1[i in S] p(y^i | y with S masked, x)^beta], S one count-form copy (k ~
    U{1..L}, a uniform k-subset, weight w = L/k): P(S) w = 1 / (k C(L, k)), a distribution over the sets
    that hold i, the same as the set still masked when a uniformly random order writes y^i."""
    L, k = masks.shape[1], masks.sum(1)
    n_sets = torch.tensor([math.comb(L, int(j)) for j in k], dtype=logp.dtype, device=logp.device)
    log_terms = (beta * logp - (k * n_sets).log()[:, None]).masked_fill(~masks, float("-inf"))
    return log_terms.logsumexp(0).sum() / beta


# -----------------------------------------------------------------------------
# 3. Exact moments: every estimator's mean and variance by enumeration of its randomness
#
# All of them read one table per sequence, log_probs_under_every_mask: logp[S, i] for
# every mask set S. a[S] = sum_{i in S} logp[S, i] over all 2^L bitmasks (a[0] = 0) is the only
# quantity the ELBO estimators see; the trajectory's states are mask sets too.


def size_stats(a, L, free=None):
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
    # U(0.2, 0.8) = 0.5 + 0.3 U(-1, 1)
    for t, wt in zip(0.5 + 0.3 * u, w / 2):
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
    logp = token_log_probs(model, prompt.expand(len(masks), -1), completion.expand(len(masks), L), masks)
    # the ELBO over F positions
    return elbo_from_table(pick, logp[:, positions])
