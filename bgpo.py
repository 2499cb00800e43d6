"""
Boundary-Guided Policy Optimization (BGPO) for a masked diffusion LM, next to the naive
ELBO-based objective it replaces, and the pipeline that runs them: SFT, then RL.

Paper: Lin, Zhang, Hou, Li, "Boundary-Guided Policy Optimization for Memory-efficient RL of
Diffusion Large Language Models", arXiv 2510.11683. Read in this order:

1. ELBO estimation with Monte Carlo samples (Eq. 4-5): draw_mc_samples, elbo_terms, and, for
   teaching and tests, the exact ELBO and the random-order likelihood by enumeration.
2. The two objectives (Eq. 6-7 and Eq. 9-14): naive_objective and bgpo_bound, then naive_loss
   and bgpo_backward, which differ only in how many graphs autograd keeps alive.
3. Measuring activation memory: ActivationMemory.
4. The pipeline: SFT (the negative ELBO), the RL loop (sample, reward, advantage, update),
   evaluation, checkpoints, figures, the memory benchmark and the command line.
The other methods of the field, the estimator lab and the field's RL objectives (--objective
diffu-grpo, stp, dtrpo) are the next chapter, estimators.py.

Simplifications versus the paper and its official code:
1. A 0.6M-parameter model trained from scratch on toy tasks instead of LLaDA-8B-Instruct.
2. The log-ratio d_j is divided by the completion length L (as the official code does; the paper
   text does not); on-policy this only rescales the gradient, off-policy it keeps ratios near 1.
3. No KL term and one update per rollout batch by default, as in the paper's main runs (the
   field's objectives default to d1's and STP's mu = 4 updates).
4. Group advantages use the unbiased (n-1) standard deviation, torch.std's default (as in TRL's
   GRPO trainer), and a group whose rewards are all equal gets exactly 0.

Shapes: B batch (= prompts x G), G group size, M Monte Carlo samples (n_t), L completion length,
P prompt length, T = P + L, V vocabulary.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import weakref
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from tasks import get_task, TASKS
from tiny_dllm import ModelConfig, TinyDLLM, generate, mask_by_count, masked_log_likelihood, sft_loss

# -----------------------------------------------------------------------------
# 1. The ELBO and its Monte Carlo estimate (Eq. 4-5)


@dataclass
class MCSamples:
    """n_t masked copies per sequence: mask (B, M, L) bool and weight (B, M), the 1/t factor.
    Drawn once per rollout batch and used for both pi_theta and pi_old (coupling)."""
    mask: torch.Tensor
    weight: torch.Tensor

    def __getitem__(self, j):  # samples j (a slice): a chunk for bgpo_backward
        return MCSamples(self.mask[:, j], self.weight[:, j])

    def rows(self, b):  # sequences b (a bool mask or indices): a part of the batch for rl_update
        return MCSamples(self.mask[b], self.weight[b])

    def to(self, device):
        return MCSamples(self.mask.to(device), self.weight.to(device))


def draw_mc_samples(batch_size, gen_len, n_mc, generator=None, scheme="stratified"):
    """M mask patterns per sequence, each an unbiased one-sample estimate of the ELBO.
    "iid":        t_j ~ U(0,1], each token masked with probability t_j, weight 1/t_j (Eq. 4).
    "stratified": LLaDA's estimator: k_0 ~ U{1..L}, then the M counts
                  k_j = ((k_0 - 1 + round(j L / M)) mod L) + 1 spread evenly over 1..L, exactly
                  k_j tokens masked, weight L/k_j. Each k_j alone is uniform, so it is unbiased;
                  spreading them removes most of the variance between samples."""
    for name, v in (("batch_size", batch_size), ("gen_len", gen_len), ("n_mc", n_mc)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")
    B, L, M = batch_size, gen_len, n_mc
    if scheme == "stratified":
        k0 = torch.randint(1, L + 1, (B, 1), generator=generator)
        offsets = torch.tensor([round(j * L / M) for j in range(M)])
        k = (k0 - 1 + offsets) % L + 1                                      # (B, M)
        mask = mask_by_count(k.flatten(), L, generator).view(B, M, L)
        return MCSamples(mask, L / k.to(torch.get_default_dtype()))
    if scheme == "iid":
        t = 1.0 - torch.rand(B, M, generator=generator)                    # (0, 1]
        return MCSamples(torch.rand(B, M, L, generator=generator) < t[..., None], 1.0 / t)
    raise ValueError(f"scheme: expected 'stratified' or 'iid', got {scheme!r}")


def elbo_terms(model, prompts, completions, mc):
    """l_j = (1/t_j) sum_{i masked in y_t} log p_theta(y^i | y_t, x), in nats: (B, M).
    All B*M masked copies go through the model as one batch."""
    _check_shapes(prompts, completions, mc)
    (B, M), L = mc.weight.shape, completions.shape[1]
    logp = masked_log_likelihood(model, prompts.repeat_interleave(M, 0),
                                 completions.repeat_interleave(M, 0), mc.mask.reshape(B * M, L).to(completions.device))
    return mc.weight.to(logp) * logp.view(B, M)


def subset_masks(L, device=None):
    """Every subset of L positions as a (2^L, L) bool row: row S is the subset with bitmask S
    (bit i = position i), row 0 the empty set."""
    bits = torch.arange(2**L, device=device)
    return (bits[:, None] >> torch.arange(L, device=device)) & 1 == 1


def log_probs_under_every_mask(model, prompt, completion, chunk=4096):
    """The enumeration table behind every exact quantity: for one prompt (P,) and completion (L,),
    masks (N, L) bool, every non-empty subset S of the L positions, and logp (N, L), where
    logp[S, i] = log p(y^i | y with S masked, x). Row r is the subset whose bitmask is r + 1
    (bit i = position i), so N = 2^L - 1 and a subset's row is found by arithmetic.
    Differentiable; chunk bounds the rows per forward pass (under no_grad, the peak memory)."""
    L = completion.shape[0]
    masks = subset_masks(L, completion.device)[1:]                                   # (N, L), no empty set
    rows = [masked_log_likelihood(model, prompt.expand(len(m), -1), completion.expand(len(m), L), m, per_token=True)
            for m in masks.split(chunk)]
    return masks, torch.cat(rows)


def exact_elbo(model, prompt, completion):
    """The ELBO by enumerating the 2^L - 1 mask sets (L <= 10 in seconds on a CPU):
    B = sum_{k=1..L} (1/k) mean_{|S|=k} sum_{i in S} log p(y^i | y with S masked, x),
    that is, sum_S a(S) / (k C(L, k)) with a(S) the masked log-likelihood and k = |S|.
    Differentiable. Both MC schemes have this expectation. RADD's theorem: it equals the expected
    log-likelihood of an any-order autoregressive model over uniformly random orders."""
    return elbo_from_table(*log_probs_under_every_mask(model, prompt, completion))


def elbo_from_table(masks, logp):
    L, k = masks.shape[1], masks.sum(1)
    a = (logp * masks).sum(1)                                                        # a(S)
    n_sets = torch.tensor([math.comb(L, int(j)) for j in k], dtype=logp.dtype, device=logp.device)
    return (a / (k * n_sets)).sum()


def random_order_log_likelihood(model, prompt, completion):
    """The likelihood of an any-order autoregressive model that reveals y one uniformly random
    position at a time, each predicted with the not-yet-revealed positions masked. Returns
    (E_sigma log p_sigma(y), log E_sigma p_sigma(y)): the first equals the ELBO (RADD), the second
    is an upper bound on it by Jensen. The L! orders sigma are not enumerated: dynamic programming
    over the 2^L sets S of still-masked positions gives both, with f(empty) = g(empty) = 0,
        f(S) = (1/|S|) sum_{i in S} [log p(y^i | S masked) + f(S - i)]
        g(S) = log (1/|S|) sum_{i in S} exp(log p(y^i | S masked) + g(S - i)),
    and the answer is (f, g) of the full set. Differentiable."""
    return random_order_from_table(*log_probs_under_every_mask(model, prompt, completion))


def random_order_from_table(masks, logp):
    L = masks.shape[1]
    size, bit = masks.sum(1), 1 << torch.arange(L, device=masks.device)
    f = g = logp.new_zeros(2**L)                                     # indexed by bitmask; f[0] = 0
    for k in range(1, L + 1):
        rows = (size == k).nonzero()[:, 0]                           # the sets of size k
        S = rows + 1
        child = S[:, None] & ~bit                                    # S - i for each i (S itself if i not in S)
        inside = masks[rows]
        f = f.index_put((S,), ((logp[rows] + f[child]) * inside).sum(1) / k)
        term = (logp[rows] + g[child]).masked_fill(~inside, float("-inf"))
        g = g.index_put((S,), term.logsumexp(1) - math.log(k))
    return f[-1], g[-1]


# -----------------------------------------------------------------------------
# 2. The objectives: naive (Eq. 6-7) and BGPO's lower bound (Eq. 9-14)


def _check_shapes(prompts, completions, mc, old_terms=None, advantages=None):
    """Every shape must match exactly: a silent broadcast would train on the wrong numbers."""
    if prompts.dim() != 2:
        raise ValueError(f"prompts: expected (B, P), got shape {tuple(prompts.shape)}")
    B = prompts.shape[0]
    if completions.dim() != 2 or completions.shape[0] != B:
        raise ValueError(f"completions: expected ({B}, L), got shape {tuple(completions.shape)}")
    L = completions.shape[1]
    if mc.mask.dim() != 3 or mc.mask.shape[0] != B or mc.mask.shape[2] != L:
        raise ValueError(f"mc.mask: expected ({B}, M, {L}), got shape {tuple(mc.mask.shape)}")
    M = mc.mask.shape[1]
    if tuple(mc.weight.shape) != (B, M):
        raise ValueError(f"mc.weight: expected ({B}, {M}), got shape {tuple(mc.weight.shape)}")
    if old_terms is not None and tuple(old_terms.shape) != (B, M):
        raise ValueError(f"old_terms: expected ({B}, {M}), got shape {tuple(old_terms.shape)}")
    if advantages is not None:
        if tuple(advantages.shape) != (B,):
            raise ValueError(f"advantages: expected ({B},), got shape {tuple(advantages.shape)}")
        if torch.isnan(advantages).any():
            raise ValueError(f"advantages: contains NaN (shape {tuple(advantages.shape)})")


def _ppo(ratio, A, clip_eps):
    """ratio * A, or PPO's pessimistic min with the ratio clipped to [1 - eps, 1 + eps]."""
    if clip_eps is None:
        return ratio * A
    return torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)


def naive_objective(d, A, clip_eps=None):
    """R_hat = exp(mean_j d_j) * A per sequence (Eq. 7): (B, M) log-ratios -> (B,).
    The exp couples all M samples: no term can be backpropagated on its own."""
    return _ppo(d.mean(1).exp(), A, clip_eps)


def bgpo_bound(d, A, n_t, clip_eps=None):
    """BGPO's per-sample terms g_j (Eq. 13): (B, m) log-ratios of m <= n_t samples -> (B, m),
    with R_lb = sum_j g_j <= R_hat.
      A >= 0: e^u >= 1 + u (tangent at 0), so exp(mean d) A >= mean(1 + d_j) A.
      A <  0: e^{mean u} <= mean e^{u_j} (Jensen), and A < 0 flips it: exp(mean d) A >= mean(e^{d_j}) A.
    Both are equal to R_hat when every d_j = 0, i.e. on-policy; 1 + d is used as is, never as
    exp(log(1 + d)), which is NaN for d <= -1."""
    A = A[:, None]
    positive = A >= 0
    ratio = torch.where(positive, 1 + d, d.masked_fill(positive, 0).exp())  # no exp where unused: no inf*0 grads
    return _ppo(ratio, A, clip_eps) / n_t


def naive_loss(model, prompts, completions, mc, old_terms, advantages, clip_eps=None):
    """-mean_b R_hat_b. One forward over all B*M masked copies; the caller calls backward,
    and until then autograd keeps the activations of all M samples: memory grows with M."""
    _check_shapes(prompts, completions, mc, old_terms, advantages)
    terms = elbo_terms(model, prompts, completions, mc)              # (B, M)
    d = (terms - old_terms) / completions.shape[1]                    # per-token log-ratio
    return -naive_objective(d, advantages.to(d), clip_eps).mean()


def bgpo_backward(model, prompts, completions, mc, old_terms, advantages, clip_eps=None, mc_chunk=1):
    """-mean_b R_lb_b, backpropagated one chunk of mc_chunk samples at a time. R_lb is a sum of
    per-sample terms, so the chunks' gradients add up to the full gradient while only one chunk's
    activations are alive: memory is that of mc_chunk samples, whatever M is. Returns the loss."""
    _check_shapes(prompts, completions, mc, old_terms, advantages)
    if not isinstance(mc_chunk, int) or mc_chunk < 1:
        raise ValueError(f"mc_chunk: must be a positive int, got {mc_chunk!r}")
    M, L = old_terms.shape[1], completions.shape[1]
    total = 0.0
    for j in range(0, M, mc_chunk):
        part = slice(j, j + mc_chunk)
        terms = elbo_terms(model, prompts, completions, mc[part])     # (B, m)
        d = (terms - old_terms[:, part]) / L
        loss = -bgpo_bound(d, advantages.to(d), M, clip_eps).sum(1).mean()
        loss.backward()
        total += loss.item()
    return total


def reward_groups(rewards, group_size):
    """(B,) rewards laid out as consecutive groups of group_size completions of the same prompt ->
    (B / group_size, group_size), after checking that they are."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected (B,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size: must be an int >= 2 dividing {rewards.shape[0]}, got {group_size!r}")
    return rewards.view(-1, group_size)


def group_advantages(rewards, group_size):
    """A = (r - mean_group r) / (std_group r + 1e-6) (Eq. 18), for rewards laid out as
    consecutive groups of group_size completions of the same prompt. Equal rewards give A = 0."""
    r = reward_groups(rewards, group_size)
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    # rounding makes mean(0.1, ..., 0.1) != 0.1, and dividing by std + 1e-6 would blow that up
    tie = r.amax(1, keepdim=True) == r.amin(1, keepdim=True)
    return A.masked_fill(tie, 0.0).flatten()


# -----------------------------------------------------------------------------
# 3. Activation memory: the bytes autograd holds for backward


class ActivationMemory:
    """Counts, while active, the peak bytes of distinct tensors saved for backward, excluding
    the parameters themselves. Each saved tensor is wrapped in a handle whose destruction (when
    backward frees the graph) releases its bytes, so the count is exact and deterministic on CPU."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live, self.current, self.peak = {}, 0, 0

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return t
        if ptr not in self.live:
            self.live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.current += self.live[ptr][0]
            self.peak = max(self.peak, self.current)
        self.live[ptr][1] += 1
        handle = _Saved(t)
        weakref.finalize(handle, self._release, ptr)
        return handle

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t if isinstance(h, _Saved) else h)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Saved:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


# -----------------------------------------------------------------------------
# 4. The pipeline: data, evaluation, checkpoints


SFT_STEPS = {"arithmetic": 1200, "countdown": 1500, "sudoku": 115}  # default --sft-steps per task


class RunError(ValueError):
    """Bad input, a bad checkpoint or a diverged run: the command line prints it as one line
    and exits with code 2."""


def pick_device(name):
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name not in ("cpu", "cuda", "mps") or (name == "cuda" and not torch.cuda.is_available()) \
            or (name == "mps" and not torch.backends.mps.is_available()):
        raise RunError(f"--device {name} is not available here")
    return name


def encode(task, prompts, answers=None, device="cpu"):
    """Prompt strings -> (N, P) tokens; answers, if given, -> (N, L) completions ending in EOS."""
    x = task.tokenizer.encode_batch(prompts, task.prompt_len, "left").to(device)
    if answers is None:
        return x
    return x, task.tokenizer.encode_batch(answers, task.gen_len, "right").to(device)


def make_model(task, args):
    config = ModelConfig(vocab_size=task.tokenizer.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                         n_embd=args.n_embd, max_len=task.prompt_len + task.gen_len,
                         mask_id=task.tokenizer.mask_id)
    return TinyDLLM(config)


@torch.no_grad()
def evaluate(model, task, prompts, args, n_show=3):
    """Greedy decoding on a fixed held-out set: exact-solve rate (reward 1), mean reward, and a
    few decoded prompt -> completion -> reward lines to look at."""
    model.eval()
    rewards, shown = [], []
    for i in range(0, len(prompts), 256):
        batch = prompts[i:i + 256]
        y = generate(model, encode(task, batch, device=args.device), task.gen_len,
                     steps=args.gen_steps, block_len=args.block_len, temperature=0.0)
        for prompt, ids in zip(batch, y.cpu()):
            text = task.decode(ids)
            rewards.append(task.reward(prompt, text))
            if len(shown) < n_show:
                shown.append(f"    {prompt} -> {text} -> reward {rewards[-1]:.2f}")
    model.train()
    accuracy = sum(r == 1.0 for r in rewards) / len(rewards)
    return {"accuracy": accuracy, "reward": sum(rewards) / len(rewards), "examples": shown}


def evaluate_all(model, task, eval_prompts, pool, args):
    """evaluate() on the held-out set, plus the exact-solve rate on the RL pool if there is one."""
    result = evaluate(model, task, eval_prompts, args)
    if pool:
        result["pool_accuracy"] = evaluate(model, task, pool[:args.eval_size], args, n_show=0)["accuracy"]
    return result


def save_checkpoint(path, **state):
    """Write to a temporary file, then rename: an interrupted save never leaves a broken file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, task, config=None):
    """Load and check that a checkpoint was made for this task, tokenizer and model config."""
    if not os.path.isfile(path):
        raise RunError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        made_for = (state["task"], state["vocab"], state["config"])
    except Exception as e:
        raise RunError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if made_for[0] != task.name:
        raise RunError(f"{path} was made for task {made_for[0]!r}, not {task.name!r}")
    if made_for[1] != task.tokenizer.itos:
        raise RunError(f"{path} was made with another tokenizer")
    if config is not None and made_for[2] != asdict(config):
        diff = {k: v for k, v in made_for[2].items() if asdict(config).get(k) != v}
        raise RunError(f"{path} was made for another model config: {diff}")
    return state


def sft_path(args):
    """The SFT checkpoint's name records every setting that changes it, so a matching one is reused."""
    name = (f"sft_{args.task}_{args.sft_steps}x{args.batch_size}_lr{args.sft_lr:g}"
            f"_l{args.n_layer}h{args.n_head}e{args.n_embd}_seed{args.seed}.pt")
    return args.sft_ckpt or os.path.join(args.out_dir, name)


# -----------------------------------------------------------------------------
# SFT: minimise the negative ELBO of the reference answers


def run_sft(args, task):
    torch.manual_seed(args.seed)  # the initial weights
    model = make_model(task, args).to(args.device)
    print(f"model: {model.num_params():,} parameters, {args.n_layer} layers, n_embd {args.n_embd}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    warmup = min(100, args.sft_steps // 10)
    schedule = lambda s: min(1.0, (s + 1) / (warmup + 1)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.sft_steps)))
    bar = tqdm(range(args.sft_steps), desc=f"SFT {args.task}", disable=None)  # hidden when not on a terminal
    t_start = last_print = time.time()
    for step in bar:
        x, y = encode(task, *task.sample(args.batch_size, "train", g), device=args.device)
        for group in optimizer.param_groups:
            group["lr"] = args.sft_lr * schedule(step)
        loss = sft_loss(model, x, y, generator=g)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if bar.disable and (time.time() - last_print >= 30 or step + 1 == args.sft_steps):
            last_print, rate = time.time(), (step + 1) / (time.time() - t_start)
            print(f"SFT step {step + 1}/{args.sft_steps} | loss {loss.item():.4f} | {rate:.1f} steps/s | "
                  f"{(args.sft_steps - step - 1) / rate:.0f} s left")
    path = sft_path(args)
    save_checkpoint(path, stage="sft", task=task.name, vocab=task.tokenizer.itos, config=asdict(model.config),
                    step=args.sft_steps, model=model.state_dict())
    print(f"saved {path}")
    return model


def load_model(path, task, args):
    config = make_model(task, args).config
    state = load_checkpoint(path, task, config)
    model = TinyDLLM(config)
    model.load_state_dict(state["model"])
    return model.to(args.device), state


# -----------------------------------------------------------------------------
# RL: BGPO (or the naive objective) on the model's own samples


def _objective_backward(model, args, x, y, rollout, A, inner=0):
    """Backpropagate the loss of --objective (of inner update `inner`) for these rows; returns its value."""
    clip_eps = args.clip_eps if args.updates_per_batch > 1 else None  # on-policy it is inactive anyway
    if args.objective in ("diffu-grpo", "stp", "dtrpo"):
        from estimators import field_loss  # the field's other methods, in the next chapter
        loss = field_loss(model, args.objective, x, y, rollout, A, inner, clip_eps, args.block_len)
    elif args.objective == "bgpo":
        return bgpo_backward(model, x, y, rollout["mc"], rollout["old_terms"], A, clip_eps, args.mc_chunk)
    elif args.objective == "trajectory":
        from estimators import trajectory_backward  # the sampler's own log-probability, in the next chapter
        return trajectory_backward(model, x, y, rollout["commit_steps"], A)
    else:
        loss = naive_loss(model, x, y, rollout["mc"], rollout["old_terms"], A, clip_eps)
    loss.backward()
    return loss.item()


def rl_update(model, optimizer, args, x, y, rollout, A, inner=0):
    """One optimizer step on the objective chosen by --objective. Every objective is a mean over
    the batch's rows, so the gradient is built in two parts, the rows with A > 0 and those with
    A < 0 (each part's A scaled by its share of the rows), which add up to the full gradient; the
    rows with A = 0 contribute nothing. Returns the loss and the parts' norms and cosine."""
    optimizer.zero_grad(set_to_none=True)
    loss, grads = 0.0, []
    for rows in (A > 0, A < 0):
        n = int(rows.sum())
        if n:
            part = {k: v.rows(rows) if hasattr(v, "rows") else v[rows] for k, v in rollout.items()}  # MCSamples
            loss += _objective_backward(model, args, x[rows], y[rows], part, A[rows] * n / len(A), inner)
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                for p in model.parameters()]))
    g_pos, g_neg = grads[0], grads[1] - grads[0]
    split = {"grad_pos": g_pos.norm().item(), "grad_neg": g_neg.norm().item(),
             "cos_pos_neg": torch.nn.functional.cosine_similarity(g_pos, g_neg, dim=0).item()}
    if math.isfinite(loss):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return loss, split


@torch.no_grad()
def prediction_entropy(model, prompts, gen_len):
    """Mean entropy (nats) of the model's prediction at each completion position with the whole
    completion masked, the sampler's first step: how sure the policy is before it writes anything."""
    masked = torch.full((prompts.shape[0], gen_len), model.config.mask_id, dtype=torch.long, device=prompts.device)
    logp = model(torch.cat([prompts, masked], 1))[:, prompts.shape[1]:].log_softmax(-1)
    return -(logp.exp() * logp.nan_to_num(0.0)).sum(-1).mean().item()  # MASK's -inf: 0 * -inf -> 0


def run_rl(args, task, model):
    from estimators import FIELD, d1_advantages, field_rollout, stp_prior  # the field's methods: the next chapter
    run_dir = os.path.join(args.out_dir, args.run_name)
    ckpt_path, log_path = os.path.join(run_dir, "ckpt.pt"), os.path.join(run_dir, "log.jsonl")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 1)
    eval_prompts, _ = task.sample(args.eval_size, "test", 1234)
    # --rl-pool N: practise on a fixed pool of N training problems instead of fresh ones each step,
    # and also evaluate on (up to --eval-size of) them, to separate learning a problem from transfer
    pool = task.sample(args.rl_pool, "train", args.seed + 2)[0] if args.rl_pool else None
    G, B = args.group_size, args.group_size * args.prompts_per_step
    start, history = 1, []
    if args.resume:
        state = load_checkpoint(ckpt_path, task, model.config)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        g.set_state(state["rng"])
        start, history = state["step"] + 1, state["history"]
        print(f"resumed {ckpt_path} at step {state['step']}")
    else:
        os.makedirs(run_dir, exist_ok=True)
        history.append({"step": 0, **evaluate_all(model, task, eval_prompts, pool, args)})
        print(f"step 0 (SFT model): accuracy {history[0]['accuracy']:.1%}, reward {history[0]['reward']:.3f}"
              + (f", pool accuracy {history[0]['pool_accuracy']:.1%}" if pool else ""))
        print("\n".join(history[0]["examples"]))
    # keep the log consistent with the checkpoint: drop lines written after it
    lines = open(log_path).read().splitlines() if args.resume and os.path.exists(log_path) else \
        [json.dumps({"step": 0, "accuracy": history[0]["accuracy"], "eval_reward": history[0]["reward"]})]
    with open(log_path, "w") as f:
        f.writelines(line + "\n" for line in lines if json.loads(line)["step"] < start)

    good_step = start - 1
    for step in range(start, args.rl_steps + 1):
        t0 = time.time()
        # 1-2. prompts, and G completions of each from the current policy
        if pool:
            prompts = [pool[i] for i in torch.randperm(len(pool), generator=g)[:args.prompts_per_step]]
        else:
            prompts, _ = task.sample(args.prompts_per_step, "train", g)
        prompts = [p for p in prompts for _ in range(G)]                         # B = prompts x G
        x = encode(task, prompts, device=args.device)                            # (B, P)
        model.eval()
        prior = stp_prior(task, prompts, model.config.mask_id) if args.objective == "stp" and not args.no_anchors else None
        y, commit_steps = generate(model, x, task.gen_len, steps=args.gen_steps, block_len=args.block_len,
                                   temperature=args.temperature, generator=g, return_steps=True,
                                   remasking=args.remasking, prior=prior, early_stop=args.stp_tau)  # (B, L), (B, L)
        model.train()
        # 3. rewards and group-relative advantages (the negative ones scaled by --neg-weight)
        texts = [task.decode(ids) for ids in y.cpu()]
        rewards = torch.tensor([task.reward(p, t) for p, t in zip(prompts, texts)])
        A = (d1_advantages if args.d1_advantages else group_advantages)(rewards, G).to(args.device)  # (B,)
        A = torch.where(A < 0, args.neg_weight * A, A)
        # 4. MC draws once per batch; the old policy's terms on the very same masks
        if args.objective == "trajectory":
            rollout = {"commit_steps": commit_steps}
        elif args.objective in FIELD:  # one draw per inner update, and the old policy's values on each
            anchors = None if prior is None else prior.to(args.device) != model.config.mask_id
            rollout = field_rollout(model, args.objective, x, y, commit_steps, args.updates_per_batch, g, anchors,
                                    args.mc_samples, args.block_len)
        else:
            mc = draw_mc_samples(B, task.gen_len, args.mc_samples, g).to(args.device)
            with torch.no_grad():
                rollout = {"mc": mc, "old_terms": elbo_terms(model, x, y, mc)}     # (B, M)
        # 5. update(s), the learning rate warmed up linearly over the first --rl-warmup steps
        for group in optimizer.param_groups:
            group["lr"] = args.rl_lr * min(1.0, step / args.rl_warmup) if args.rl_warmup else args.rl_lr
        with ActivationMemory(model) as memory:
            for j in range(args.updates_per_batch):
                loss, split = rl_update(model, optimizer, args, x, y, rollout, A, j)
                if not math.isfinite(loss):  # the update was skipped; the checkpoint on disk is untouched
                    kept = f"{ckpt_path} (step {good_step})" if good_step else "none yet"
                    raise RunError(f"loss is {loss} at RL step {step}; stopped. Last good checkpoint: {kept}")
        # 6-8. log, evaluate, save
        record = {"step": step, "reward": rewards.mean().item(), "loss": loss,
                  "activation_mb": memory.peak / 2**20, "seconds": time.time() - t0,
                  # what the rollouts are: solved, well-formed, and how sure the policy was
                  "solved": (rewards == 1.0).float().mean().item(),
                  "valid": sum(map(task.valid, prompts, texts)) / B,
                  "entropy": prediction_entropy(model, x, task.gen_len),
                  "rollout_passes": int(commit_steps.max()) + 1, **split}  # the sampler's forward passes
        line = f"step {step:4d} | reward {record['reward']:.3f} | loss {loss:+.4f} | act {record['activation_mb']:.1f} MB | {record['seconds']:.2f} s"
        if step % args.eval_every == 0 or step == args.rl_steps:
            result = evaluate_all(model, task, eval_prompts, pool, args)
            history.append({"step": step, **result})
            record["accuracy"] = result["accuracy"]
            line += f" | held-out accuracy {result['accuracy']:.1%} (reward {result['reward']:.3f})"
            if pool:
                record["pool_accuracy"] = result["pool_accuracy"]
                line += f" | pool accuracy {result['pool_accuracy']:.1%}"
            line += "\n" + "\n".join(result["examples"])
        print(line)
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if step % args.save_every == 0 or step == args.rl_steps:
            save_checkpoint(ckpt_path, stage="rl", task=task.name, vocab=task.tokenizer.itos,
                            config=asdict(model.config), step=step, model=model.state_dict(),
                            optimizer=optimizer.state_dict(), rng=g.get_state(), history=history)
            good_step = step
    if args.plot:
        draw(curves_figure({args.run_name: read_log(log_path)}), os.path.join(run_dir, "curves.png"))
    return history


# -----------------------------------------------------------------------------
# Figures: each is first plain data, the lines it plots (which the tests check), then drawn by
# draw(), the one function that needs matplotlib; without it every command still runs


def read_log(path):
    return [json.loads(line) for line in open(path)]


def mean_of_runs(logs):
    """Several runs' records (seeds) -> one: at each step, the mean reward and accuracy of the runs."""
    if len(logs) == 1:
        return logs[0]
    steps = sorted({r["step"] for records in logs for r in records})
    at = [{r["step"]: r for r in records} for records in logs]
    return [{"step": s, **{k: statistics.mean(run[s][k] for run in at) for k in ("reward", "accuracy")
                           if all(k in run.get(s, {}) for run in at)}} for s in steps]


def smooth(ys, window=10):
    return [sum(ys[max(0, i - window + 1):i + 1]) / min(i + 1, window) for i in range(len(ys))]


def curves_figure(runs):
    """The paper's Fig. 2 in small: {label: a run's log.jsonl records} -> the rollout reward (mean of
    the last 10 steps; for a single run also each step's, faint) and the held-out accuracy against the
    RL step, one line per run."""
    reward, accuracy = [], []
    for label, records in runs.items():
        steps, evals = [r for r in records if "reward" in r], [r for r in records if "accuracy" in r]
        if len(runs) == 1:
            reward.append({"label": "each step", "x": [r["step"] for r in steps], "y": [r["reward"] for r in steps],
                           "alpha": 0.3})
        reward.append({"label": label, "x": [r["step"] for r in steps], "y": smooth([r["reward"] for r in steps])})
        accuracy.append({"label": label, "x": [r["step"] for r in evals], "y": [r["accuracy"] for r in evals], "style": "o-"})
    return {"panels": [{"title": "rollout reward (mean of the last 10 steps)", "xlabel": "RL step", "lines": reward},
                       {"title": "held-out accuracy (greedy)", "xlabel": "RL step", "lines": accuracy}]}


def memory_figure(rows):
    """The paper's Fig. 1 in small: --bench-memory's rows -> activation memory of one update and the
    step-time ratio against n_t (and the CUDA allocator's peak, when measured)."""
    n = [r["n_t"] for r in rows]
    memory = [{"label": name, "x": n, "y": [r[key] for r in rows], "style": "o-"}
              for name, key in (("naive", "naive_mb"), ("BGPO", "bgpo_mb"), ("naive, CUDA allocator", "naive_cuda_mb"),
                                ("BGPO, CUDA allocator", "bgpo_cuda_mb")) if key in rows[0]]
    ratio = [{"label": "BGPO / naive", "x": n, "y": [r["bgpo_s"] / r["naive_s"] for r in rows], "style": "o-"}]
    return {"panels": [{"title": "activation memory of one update (MB)", "xlabel": "n_t", "xscale": "log",
                        "yscale": "log", "lines": memory},
                       {"title": "step time, BGPO / naive", "xlabel": "n_t", "xscale": "log", "lines": ratio}]}


def draw(figure, png_path):
    """One PNG, a panel per figure["panels"] entry, a line per panel["lines"] entry."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; skipped {png_path}")
        return None
    panels = figure["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.3), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for line in panel["lines"]:
            ax.plot(line["x"], line["y"], line.get("style", "-"), label=line["label"], alpha=line.get("alpha", 1.0),
                    markersize=3)
        ax.set(xlabel=panel["xlabel"], xscale=panel.get("xscale", "linear"), yscale=panel.get("yscale", "linear"))
        ax.set_title(panel["title"], fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    print(f"wrote {png_path}")
    return png_path


# -----------------------------------------------------------------------------
# The memory benchmark: naive vs BGPO as n_t grows, on one RL batch of a real task


def bench_memory(args, task):
    torch.manual_seed(args.seed)
    model = make_model(task, args).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    B = args.group_size * args.prompts_per_step
    g = torch.Generator().manual_seed(args.seed)
    x, y = encode(task, *task.sample(B, "train", g), device=args.device)
    A = group_advantages(torch.randint(0, 2, (B,), generator=g).to(torch.get_default_dtype()), args.group_size)
    A = A.to(args.device)
    cuda = args.device == "cuda"
    commit = torch.rand(B, task.gen_len, generator=g).argsort(1).argsort(1).to(args.device)  # an order, for dtrpo
    from estimators import FIELD, every_objective_table, field_rollout

    def measure(objective, n_t, mc_chunk=1):
        step_args = argparse.Namespace(**{**vars(args), "objective": objective, "mc_chunk": mc_chunk,
                                          "updates_per_batch": 1, "block_len": None})
        if objective in FIELD:
            rollout = field_rollout(model, objective, x, y, commit, 1, g, num_t=n_t)
        elif objective == "trajectory":
            rollout = {"commit_steps": commit}
        else:
            mc = draw_mc_samples(B, task.gen_len, n_t, g).to(args.device)
            with torch.no_grad():
                rollout = {"mc": mc, "old_terms": elbo_terms(model, x, y, mc)}
        times = []
        for _ in range(args.bench_repeats):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with ActivationMemory(model) as memory:  # the whole batch at once, as the objectives are written
                optimizer.zero_grad(set_to_none=True)
                _objective_backward(model, step_args, x, y, rollout, A)
                optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        cuda_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
        return memory.peak / 2**20, statistics.median(times), cuda_mb

    print(f"model {model.num_params() / 1e6:.2f}M params | task {task.name} | batch B = {args.group_size} x "
          f"{args.prompts_per_step} = {B}, L = {task.gen_len} | device {args.device} | "
          f"median of {args.bench_repeats} update steps")
    head = f"{'n_t':>4} | {'naive MB':>9} {'BGPO MB':>8} {'naive/BGPO':>10} | {'naive s':>8} {'BGPO s':>7} {'BGPO/naive':>10}"
    head += f" | {'naive CUDA MB':>13} {'BGPO CUDA MB':>12}" if cuda else ""
    print(head)
    rows = []
    for n_t in (1, 2, 4, 8, 16, 32, 64):
        naive, bgpo = measure("naive", n_t, 1), measure("bgpo", n_t, 1)
        rows.append({"n_t": n_t, "naive_mb": naive[0], "bgpo_mb": bgpo[0], "naive_s": naive[1], "bgpo_s": bgpo[1]})
        if cuda:
            rows[-1].update(naive_cuda_mb=naive[2], bgpo_cuda_mb=bgpo[2])
        row = (f"{n_t:>4} | {naive[0]:>9.1f} {bgpo[0]:>8.1f} {naive[0] / bgpo[0]:>10.2f} | "
               f"{naive[1]:>8.3f} {bgpo[1]:>7.3f} {bgpo[1] / naive[1]:>10.2f}")
        print(row + (f" | {naive[2]:>13.1f} {bgpo[2]:>12.1f}" if cuda else ""))
    n_t = args.mc_samples
    print(f"\nBGPO at n_t = {n_t}: --mc-chunk trades memory for speed")
    print(f"{'mc_chunk':>8} | {'BGPO MB':>8} | {'BGPO s':>7}" + (f" | {'CUDA MB':>8}" if cuda else ""))
    for chunk in sorted({1, 2, 4, 8, n_t}):
        if chunk <= n_t:
            mb, s, cuda_mb = measure("bgpo", n_t, chunk)
            print(f"{chunk:>8} | {mb:>8.1f} | {s:>7.3f}" + (f" | {cuda_mb:>8.1f}" if cuda else ""))
    every_objective_table(measure, task.gen_len, cuda)
    if args.plot:
        os.makedirs(args.out_dir, exist_ok=True)
        draw(memory_figure(rows), os.path.join(args.out_dir, f"memory_{task.name}_{args.device}.png"))
    return rows


# -----------------------------------------------------------------------------
# Command line


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, without the usage dump
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def positive_int(s):
    if not s.lstrip("-").isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return int(s)


def non_negative_int(s):
    if not s.lstrip("-").isdigit() or int(s) < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}")
    return int(s)


def positive_float(s):
    try:
        v = float(s)
    except ValueError:
        v = -1.0
    if not v > 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def parse_args(argv=None):
    p = ArgumentParser(prog="bgpo.py", description="SFT then BGPO reinforcement learning of a tiny masked diffusion LM.")
    # what to run
    p.add_argument("--stage", choices=["sft", "rl", "all"], default="all", help="sft, rl (from the SFT checkpoint), or both (default: %(default)s)")
    p.add_argument("--task", default="countdown", help=f"one of {', '.join(TASKS)} (default: %(default)s)")
    p.add_argument("--out-dir", default="out", help="where checkpoints and logs go (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data and sampling (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda or mps (default: %(default)s)")
    p.add_argument("--bench-memory", action="store_true", help="print the naive vs BGPO memory and time table, then exit (default: %(default)s)")
    p.add_argument("--bench-estimators", action="store_true", help="measure every likelihood estimator of estimators.py against exact enumeration on the SFT model's rollouts, then exit (default: %(default)s)")
    p.add_argument("--dtrpo-offline", action="store_true", help="dTRPO as published: DPO on the SFT model's solved and unsolved rollouts, then exit (default: %(default)s)")
    p.add_argument("--bench-repeats", type=positive_int, default=3, help="update steps timed per row of --bench-memory (default: %(default)s)")
    # model
    p.add_argument("--n-layer", type=positive_int, default=3, help="transformer blocks (default: %(default)s)")
    p.add_argument("--n-head", type=positive_int, default=4, help="attention heads (default: %(default)s)")
    p.add_argument("--n-embd", type=positive_int, default=128, help="embedding width (default: %(default)s)")
    # SFT
    p.add_argument("--sft-steps", type=positive_int, default=None, help=f"SFT steps (default: per task, {SFT_STEPS})")
    p.add_argument("--batch-size", type=positive_int, default=128, help="SFT batch size (default: %(default)s)")
    p.add_argument("--sft-lr", type=positive_float, default=1e-3, help="SFT peak learning rate (default: %(default)s)")
    p.add_argument("--sft-ckpt", default=None, help="SFT checkpoint to write or read (default: a name in --out-dir made from the settings)")
    # RL
    p.add_argument("--rl-steps", type=positive_int, default=200, help="RL steps, one rollout batch each (default: %(default)s)")
    p.add_argument("--objective", choices=["bgpo", "naive", "trajectory", "diffu-grpo", "stp", "dtrpo"], default="bgpo", help="BGPO's lower bound, the naive ELBO objective, the control (REINFORCE on the sampler's trajectory log-probability), or one of the field's methods in estimators.py (default: %(default)s)")
    p.add_argument("--prompts-per-step", type=positive_int, default=16, help="prompts per RL step (default: %(default)s)")
    p.add_argument("--group-size", type=positive_int, default=8, help="completions per prompt, G (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (default: %(default)s)")
    p.add_argument("--remasking", choices=["low_confidence", "random"], default="low_confidence", help="which positions a rollout step commits: the most confident, or uniformly random ones (default: %(default)s)")
    p.add_argument("--neg-weight", type=float, default=1.0, help="scale of the negative advantages, in [0, 1] (default: %(default)s)")
    p.add_argument("--mc-samples", type=positive_int, default=None, help="MC samples n_t per completion, for bgpo, naive and stp (default: 16; STP's num_t: 3)")
    p.add_argument("--mc-chunk", type=positive_int, default=1, help="MC samples per backward in BGPO (default: %(default)s)")
    p.add_argument("--updates-per-batch", type=int, default=None, help="optimizer steps per rollout batch (mu); 1 = on-policy (default: 1; 4 for diffu-grpo, stp, dtrpo)")
    p.add_argument("--clip-eps", type=positive_float, default=None, help="PPO clip, used when --updates-per-batch > 1 (default: 0.2; d1's 0.5 for diffu-grpo)")
    p.add_argument("--stp-tau", type=float, default=None, help="STP's early stop: fill the rest in one pass once this fraction of tokens is in place (default: 0.75 with --objective stp)")
    p.add_argument("--no-anchors", action="store_true", help="STP without its spatial pruning (no anchors), for the ablation (default: %(default)s)")
    p.add_argument("--d1-advantages", action="store_true", help="diffu-grpo with d1's advantage, reward minus group mean (default: z-scored, Eq. 18)")
    p.add_argument("--rl-lr", type=positive_float, default=5e-5, help="RL learning rate (default: %(default)s)")
    p.add_argument("--rl-warmup", type=non_negative_int, default=0, help="RL steps of linear learning-rate warmup (default: %(default)s)")
    p.add_argument("--rl-pool", type=non_negative_int, default=0, help="practise on a fixed pool of N training problems; 0 = fresh problems every step (default: %(default)s)")
    p.add_argument("--eval-every", type=positive_int, default=25, help="held-out evaluation every N RL steps (default: %(default)s)")
    p.add_argument("--eval-size", type=positive_int, default=500, help="held-out problems (default: %(default)s)")
    p.add_argument("--save-every", type=positive_int, default=25, help="checkpoint every N RL steps (default: %(default)s)")
    p.add_argument("--run-name", default=None, help="RL run folder in --out-dir (default: task_objective[_ntM][_tauT][_noanchors][_d1adv][_random]_uK[_poolN]_seedS)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-name from its last checkpoint (default: %(default)s)")
    p.add_argument("--plot", action="store_true", help="draw the run's curves (or the benchmark's figure) as a PNG, if matplotlib is installed (default: %(default)s)")
    p.add_argument("--compare", nargs="+", metavar="RUN", default=None, help="draw the curves of these RL runs (folders in --out-dir) in one figure, compare.png, then exit; LABEL=RUN,RUN,... draws their mean as one line (default: %(default)s)")
    # sampler
    p.add_argument("--gen-steps", type=positive_int, default=None, help="denoising steps per completion (default: L, one token per step)")
    p.add_argument("--block-len", type=positive_int, default=None, help="semi-autoregressive block length (default: L, one block)")
    args = p.parse_args(argv)

    if args.task not in TASKS:
        p.error(f"unknown task {args.task!r}; choose one of {', '.join(TASKS)}")
    L = get_task(args.task).gen_len
    args.sft_steps = args.sft_steps or SFT_STEPS[args.task]
    for flag, given, objective in (("--stp-tau", args.stp_tau is not None, "stp"), ("--no-anchors", args.no_anchors, "stp"),
                                   ("--d1-advantages", args.d1_advantages, "diffu-grpo"), ("--mc-chunk", args.mc_chunk > 1, "bgpo")):
        if given and args.objective != objective:
            p.error(f"{flag} is an option of --objective {objective}, not {args.objective}")
    if args.stp_tau is not None and not 0 < args.stp_tau <= 1:
        p.error(f"--stp-tau must be in (0, 1], got {args.stp_tau}")
    args.stp_tau = args.stp_tau or (0.75 if args.objective == "stp" else None)
    args.mc_samples = args.mc_samples or (3 if args.objective == "stp" else 16)
    field = args.objective in ("diffu-grpo", "stp", "dtrpo")  # d1 and STP: mu = 4 inner updates by default
    args.updates_per_batch = (4 if field else 1) if args.updates_per_batch is None else args.updates_per_batch
    args.clip_eps = args.clip_eps or (0.5 if args.objective == "diffu-grpo" else 0.2)
    pool_tag = f"_pool{args.rl_pool}" if args.rl_pool else ""
    estimator = f"_nt{args.mc_samples}" if args.objective in ("bgpo", "naive", "stp") else ""  # the others draw no masked copies
    remasking = "_random" if args.remasking == "random" else ""
    options = (f"_tau{args.stp_tau}" if args.stp_tau else "") + ("_noanchors" if args.no_anchors else "") + \
        ("_d1adv" if args.d1_advantages else "")
    args.run_name = args.run_name or (f"{args.task}_{args.objective}{estimator}{options}{remasking}"
                                      f"_u{args.updates_per_batch}{pool_tag}_seed{args.seed}")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be divisible by --n-head {args.n_head}")
    if args.group_size < 2:
        p.error(f"--group-size must be at least 2 (group advantages compare completions), got {args.group_size}")
    if args.mc_chunk > args.mc_samples:
        p.error(f"--mc-chunk {args.mc_chunk} is larger than --mc-samples {args.mc_samples}")
    if args.updates_per_batch < 1:
        p.error(f"--updates-per-batch must be at least 1, got {args.updates_per_batch}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 <= args.neg_weight <= 1:
        p.error(f"--neg-weight must be in [0, 1], got {args.neg_weight}")
    if args.objective == "trajectory" and args.updates_per_batch > 1:
        p.error("--objective trajectory is on-policy: use it with --updates-per-batch 1")
    if args.block_len and args.block_len > L or args.gen_steps and args.gen_steps > L:
        p.error(f"--block-len and --gen-steps must be at most the completion length {L} of {args.task}")
    if args.gen_steps and args.gen_steps < math.ceil(L / (args.block_len or L)):
        p.error(f"--gen-steps must be at least the number of blocks, {math.ceil(L / (args.block_len or L))}")
    if 0 < args.rl_pool < args.prompts_per_step:
        p.error(f"--rl-pool {args.rl_pool} is smaller than --prompts-per-step {args.prompts_per_step}")
    if args.compare:  # {label: "RUN,RUN,..."}; a bare RUN is its own label
        args.compare = dict(s.split("=", 1) if "=" in s else (s, s) for s in args.compare)
    missing = [r for runs in (args.compare or {}).values() for r in runs.split(",")
               if not os.path.isfile(os.path.join(args.out_dir, r, "log.jsonl"))]
    if missing:
        p.error(f"--compare: no log.jsonl in {os.path.join(args.out_dir, missing[0])}")
    if args.resume and not os.path.isfile(os.path.join(args.out_dir, args.run_name, "ckpt.pt")):
        p.error(f"--resume: no run to resume at {os.path.join(args.out_dir, args.run_name, 'ckpt.pt')}")
    if args.resume and args.stage == "sft":
        p.error("--resume continues an RL run; use it with --stage rl or all")
    try:
        args.device = pick_device(args.device)
    except RunError as e:
        p.error(str(e))
    return args


def main(argv=None):
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # every progress line reaches a log file as it is printed
    args = parse_args(argv)
    task = get_task(args.task)
    t0 = time.time()
    if args.bench_memory:
        return bench_memory(args, task)
    if args.compare:
        runs = {label: mean_of_runs([read_log(os.path.join(args.out_dir, r, "log.jsonl")) for r in runs.split(",")])
                for label, runs in args.compare.items()}
        return draw(curves_figure(runs), os.path.join(args.out_dir, "compare.png"))
    print(f"task {task.name} | device {args.device} | seed {args.seed}")
    reuse = args.stage == "all" or args.bench_estimators or args.dtrpo_offline
    if args.stage in ("sft", "all") and not (reuse and os.path.isfile(sft_path(args))):
        model = run_sft(args, task)
    else:
        model, _ = load_model(sft_path(args), task, args)
        print(f"loaded the SFT model from {sft_path(args)} ({model.num_params():,} parameters)")
    if args.bench_estimators or args.dtrpo_offline:
        from estimators import bench_estimators, offline_dtrpo  # a chapter of its own; it imports this file
        return (bench_estimators if args.bench_estimators else offline_dtrpo)(args, task, model)
    if args.stage == "sft":
        result = evaluate(model, task, task.sample(args.eval_size, "test", 1234)[0], args)
        print(f"SFT held-out accuracy {result['accuracy']:.1%}, mean reward {result['reward']:.3f}")
        print("\n".join(result["examples"]))
        print(f"done in {time.time() - t0:.0f} s")
        return result
    history = run_rl(args, task, model)
    first, last = history[0], history[-1]
    print(f"\n{'':>22} {'accuracy':>9} {'reward':>7}")
    print(f"{'SFT model':>22} {first['accuracy']:>9.1%} {first['reward']:>7.3f}")
    print(f"{'after ' + str(last['step']) + ' RL steps':>22} {last['accuracy']:>9.1%} {last['reward']:>7.3f}")
    how = f"n_t = {args.mc_samples}" if args.objective in ("bgpo", "naive", "stp") else f"{args.remasking} remasking"
    print(f"({args.objective}, {how}, {args.updates_per_batch} update(s) per batch, {time.time() - t0:.0f} s on {args.device})")
    run_dir = os.path.join(args.out_dir, args.run_name)
    written = [sft_path(args)] + [os.path.join(run_dir, f) for f in ("ckpt.pt", "log.jsonl", "curves.png")]
    print("files: " + ", ".join(f for f in written if os.path.isfile(f)))
    return history


if __name__ == "__main__":
    try:
        main()
    except RunError as e:
        print(f"bgpo.py: error: {e}", file=sys.stderr)
        sys.exit(2)
