"""
A tiny masked diffusion language model (dLLM): the network, the forward (masking) process, the
supervised loss (a negative ELBO) and the sampler; last, a meter of the activation memory autograd keeps.

Follows LLaDA (Nie et al., 2025) and RADD (Ou et al., ICLR 2025). A clean completion y of length
L is corrupted by replacing a random subset of its tokens with MASK; the network sees the prompt x
and the corrupted y_t and predicts the clean token at every masked position. RADD showed that for
masking (absorbing) diffusion the optimal predictor does not depend on the noise level t, so the
network takes no time input: it is a plain bidirectional transformer.

Simplifications versus LLaDA:
1. 3 layers and ~0.6M parameters instead of 8B; learned absolute positions instead of RoPE;
   LayerNorm and GELU instead of RMSNorm and SwiGLU.
2. No attention mask: prompts are left-padded with a PAD token that the model simply learns to
   ignore, and every task has one fixed completion length L.
3. The supervised loss uses one masked copy per completion, with the mask count k drawn uniformly
   from 1..L (weight L/k) by default. LLaDA draws t ~ U(0,1), masks each token with probability
   p_mask = (1 - f) t + f, a floor f = 1e-3, and weights by 1/p_mask (at most 1000). scheme="iid" here is
   that form without the floor: t ~ U(0,1], weight 1/t, unbounded, so its variance is infinite
   (log-divergent as t -> 0). Both estimate the same ELBO (LLaDA's up to its floor, an O(f) change); on
   4-16-token completions the count form's far lower variance makes SFT several times faster.

Shapes: B batch, M masked copies per completion (n_t), N rows given to the network (B, or B x M copies),
L completion length, P prompt length, T = P + L, V vocabulary, C embedding width.
"""
import math
import statistics
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# Config -----------------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    vocab_size: int
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 128
    max_len: int = 48      # longest prompt + completion the position table holds
    mask_id: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd: {self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0 <= self.mask_id < self.vocab_size:
            raise ValueError(f"mask_id: {self.mask_id} is outside the vocabulary of {self.vocab_size}")

# Model: a bidirectional transformer with no time input ------------------------------------------------------

class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, h):
        N, T, C = h.shape
        query, key, value = self.qkv(self.ln_1(h)).split(C, dim=2)
        query, key, value = (z.view(N, T, self.n_head, C // self.n_head).transpose(1, 2)
                             for z in (query, key, value))
        a = F.scaled_dot_product_attention(query, key, value, is_causal=False)  # every token sees every token
        h = h + self.proj(a.transpose(1, 2).reshape(N, T, C))
        return h + self.mlp(self.ln_2(h))

class TinyDLLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.max_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # MASK is noise, never a clean token: its logit is -inf, so it has probability 0.
        never = torch.zeros(config.vocab_size, dtype=torch.bool)
        never[config.mask_id] = True
        self.register_buffer("never_predict", never, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens):  # (N, T) long -> (N, T, V) logits
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens: expected an (N, T) long tensor, got {tuple(tokens.shape)} "
                             f"{tokens.dtype}")
        N, T = tokens.shape
        if T > self.config.max_len:
            raise ValueError(f"tokens: length {T} exceeds config.max_len={self.config.max_len}")
        h = self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device))
        for block in self.blocks:
            h = block(h)
        # under bf16 autocast the matmuls run in bf16; the logits come back in the weights' dtype (float32),
        # so that every log-softmax, ELBO term and bound after them is computed in float32
        logits = self.head(self.ln_f(h)).to(self.head.weight.dtype)
        return logits.masked_fill(self.never_predict, float("-inf"))

# Forward process: which completion tokens are masked, and the weight of each masked copy --------------------

def mask_by_count(k, L, generator=None):
    """(N,) mask counts -> (N, L) bool masks with exactly k[n] positions chosen uniformly."""
    scores = torch.rand(k.shape[0], L, generator=generator, device=k.device)
    ranks = scores.argsort(dim=1).argsort(dim=1)  # a uniformly random permutation per row
    return ranks < k[:, None]

def count_offsets(L, M, device="cpu"):
    """round(j L / M) for j = 0..M-1, halves to even as Python's round, in integers: the same on every device
    (CUDA divides a float by a host number as a multiplication by its inverse, which can turn 1.5 into
    1.4999999999999998), and made there, with no copy from the host. (M,) long."""
    jL = torch.arange(M, device=device) * L
    q, r = jL // M, jL % M
    return q + ((2 * r > M) | ((2 * r == M) & (q % 2 == 1))).long()

def forward_process(batch_size, gen_len, n_t=1, generator=None, scheme="stratified"):
    """n_t masked copies of each completion: (B, M, L) bool masks and (B, M) weights 1/t, in
    torch's default dtype. Each copy alone is an unbiased one-copy estimate of the ELBO (Eq. 4).
    "stratified": after LLaDA's estimator: k_0 ~ U{1..L}, then the M counts
                  k_j = ((k_0 - 1 + round(j L / M)) mod L) + 1, k_0 shifted by offsets that spread
                  the counts over 1..L (L = 4, M = 8: 0,0,1,2,2,2,3,4; halves round to even), exactly k_j
                  tokens masked, weight L/k_j (t = k/L). Each k_j alone is uniform, so every copy is
                  unbiased for every L and M; spreading them removes most of the variance between
                  copies. With M = 1 this is the count form: k ~ U{1..L}, weight L/k.
                  LLaDA's get_log_likelihood.py rounds k_0 + j L / M instead (half to even): the
                  same counts when M divides L (its lengths), but otherwise the pooled law of the
                  counts can be non-uniform and the estimate biased (L = 4, M = 8: law x L =
                  [0.5, 1.5, 0.5, 1.5]); test_bgpo.py compares the two laws for every L <= 16.
    "iid":        t_j ~ U(0,1], each token masked with probability t_j, weight 1/t_j."""
    for name, v in (("batch_size", batch_size), ("gen_len", gen_len), ("n_t", n_t)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")
    B, L, M = batch_size, gen_len, n_t
    device = "cpu" if generator is None else generator.device      # draws are made where the generator is
    if scheme == "stratified":
        k0 = torch.randint(1, L + 1, (B, 1), generator=generator, device=device)
        k = (k0 - 1 + count_offsets(L, M, device)) % L + 1                                     # (B, M)
        return mask_by_count(k.flatten(), L, generator).view(B, M, L), L / k.to(torch.get_default_dtype())
    if scheme == "iid":
        t = 1.0 - torch.rand(B, M, generator=generator, device=device)  # in (0, 1]: never divide by zero
        return torch.rand(B, M, L, generator=generator, device=device) < t[..., None], 1.0 / t
    raise ValueError(f"scheme: expected 'stratified' or 'iid', got {scheme!r}")

def masked_log_likelihood(model, prompts, completions, mask):
    """sum_{i masked} log p_theta(y^i | y_t, x) for each row: (N,) in the model's dtype.
    prompts (N, P), completions (N, L), mask (N, L) bool. The prompt is never masked."""
    P = prompts.shape[1]
    y_t = completions.masked_fill(mask, model.config.mask_id)
    logits = model(torch.cat([prompts, y_t], dim=1))[:, P:]             # (N, L, V)
    logp = logits.log_softmax(-1).gather(-1, completions[..., None])[..., 0]  # (N, L)
    return (logp * mask).sum(-1)

def sft_loss(model, prompts, completions, generator=None, scheme="stratified"):
    """Negative ELBO per completion token (Eq. 4 averaged over the batch, divided by L), with one
    masked copy per completion: -(1/L) E_t [ (1/t) sum_{i masked} log p(y^i | y_t, x) ]."""
    N, L = completions.shape
    mask, weight = forward_process(N, L, 1, generator, scheme)
    mask, weight = mask[:, 0].to(completions.device), weight[:, 0].to(completions.device)
    logp = masked_log_likelihood(model, prompts, completions, mask)
    return -(weight.to(logp.dtype) * logp).mean() / L

# Sampler: iterative unmasking with low-confidence remasking (LLaDA, Nie et al. 2025) ------------------------

@torch.no_grad()
def generate(model, prompts, gen_len, steps=None, block_len=None, temperature=0.0, generator=None,
             return_steps=False):
    """LLaDA's sampler: fill a completion of gen_len tokens, starting all MASK. prompts (B, P).

    Blocks of block_len tokens are filled left to right (semi-autoregressive); inside a block,
    each sampler step predicts every masked position, then commits only the n_commit most confident
    predictions and leaves the rest masked. LLaDA calls this "low-confidence remasking": predict all,
    remask the least confident. Confidence is the model's probability of the chosen token; a block's tokens
    are spread as evenly as possible over its share of the `steps` sampler steps. temperature 0 is greedy.
    With return_steps=True also returns the (B, L) sampler step at which each position was committed."""
    steps, block_len = gen_len if steps is None else steps, gen_len if block_len is None else block_len
    num_blocks = math.ceil(gen_len / block_len) if 1 <= block_len <= gen_len else 0
    if num_blocks == 0 or not num_blocks <= steps <= gen_len or temperature < 0:
        raise ValueError(f"block_len, steps, temperature: expected 1..{gen_len}, {num_blocks or 1}.."
                         f"{gen_len} (a step per block), >= 0; got {block_len}, {steps}, {temperature}")
    B, P = prompts.shape
    completion = torch.full((B, gen_len), model.config.mask_id, dtype=torch.long, device=prompts.device)
    tokens = torch.cat([prompts, completion], 1)                         # (B, T)
    committed_at = torch.full((B, gen_len), -1, dtype=torch.long, device=prompts.device)
    step = 0
    for b in range(num_blocks):
        lo, hi = P + b * block_len, P + min((b + 1) * block_len, gen_len)
        block_steps = steps // num_blocks + (b < steps % num_blocks)     # as even as possible
        for s in range(block_steps):
            n_commit = (hi - lo) // block_steps + (s < (hi - lo) % block_steps)  # tokens this sampler step
            if n_commit == 0:
                continue                      # a short last block can have more steps than tokens
            logits = model(tokens).float()                               # (B, T, V)
            if temperature == 0:
                x0 = logits.argmax(-1)                                   # (B, T) a token everywhere
            else:  # Gumbel-max sampling from softmax(logits / temperature); noise from the generator's device
                device = "cpu" if generator is None else generator.device
                u = torch.rand(logits.shape, generator=generator, device=device).clamp(1e-10, 1 - 1e-10)
                x0 = (logits + temperature * -torch.log(-torch.log(u)).to(logits.device)).argmax(-1)
            confidence = logits.softmax(-1).gather(-1, x0[..., None])[..., 0]
            candidate = torch.zeros_like(tokens, dtype=torch.bool)
            candidate[:, lo:hi] = tokens[:, lo:hi] == model.config.mask_id   # the block's masked positions
            chosen = confidence.masked_fill(~candidate, -1.0).topk(n_commit, dim=1).indices   # (B, n_commit)
            tokens.scatter_(1, chosen, x0.gather(1, chosen))
            committed_at.scatter_(1, chosen - P, step)
            step += 1
    completions = tokens[:, P:]
    return (completions, committed_at) if return_steps else completions

# Activation memory: the bytes autograd keeps for backward (BGPO: flat in n_t); one update measured ----------

class ActivationMemory(torch.autograd.graph.saved_tensors_hooks):
    """While active (a with block), counts the peak bytes of distinct tensors saved for backward,
    excluding the parameters. Each saved tensor is wrapped in a handle whose destruction (when
    backward frees the graph) releases its bytes, so the count is exact and deterministic on CPU."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live, self.current, self.peak = {}, 0, 0   # live: storage -> [bytes, handles alive]
        self.handles = weakref.WeakSet()
        super().__init__(self._pack, lambda h: h.t if isinstance(h, _Saved) else h)

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
        self.handles.add(handle)
        weakref.finalize(handle, self._release, ptr)
        return handle

    def _release(self, ptr):
        self.live[ptr][1] -= 1
        if self.live[ptr][1] == 0:
            self.current -= self.live.pop(ptr)[0]

    def __enter__(self):
        super().__enter__()
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is not None:
            # A graph left without backward (an update out of memory, say) is never freed: a handle holds its
            # tensor, whose graph holds the handle, a cycle through C++ that no collector sees. Cut it.
            for handle in self.handles:
                handle.t = None

class _Saved:  # a handle whose garbage collection tells us autograd let go of the tensor
    def __init__(self, t):
        self.t = t

def out_of_memory(error):
    """Whether an error is the device's memory running out: CUDA's torch.OutOfMemoryError (a RuntimeError),
    or Apple's MPS's plain RuntimeError (MPSAllocator.mm: TORCH_CHECK(false, "MPS backend out of memory"))."""
    return isinstance(error, torch.OutOfMemoryError) or "MPS backend out of memory" in str(error)

def measure_update(model, update, repeats=3):
    """update(), the forward and backward passes of an update without its optimizer step, measured: its
    activation memory in a pass of its own (the hooks cost Python time), then the median seconds of `repeats`
    more calls and, on CUDA, the allocator's peak over all of them. Returns {"mb": activation MiB, "s":
    seconds, "cuda_mb": MiB, or None off CUDA}, or None if update() ran out of memory."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with ActivationMemory(model) as memory:
            update()
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)  # CUDA runs asynchronously: time only this call's work
            t0 = time.perf_counter()
            update()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return {"mb": memory.peak / 2**20, "s": statistics.median(times),
                "cuda_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None}
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        return None
    finally:
        model.zero_grad(set_to_none=True)
