"""
RADD's time-discretised sampler with its cache (Ou et al., "Your Absorbing Discrete Diffusion Secretly
Models the Conditional Distributions of Clean Data", ICLR 2025): because the network takes no time
input, a sequence that did not change since its last call needs no new forward pass.
tiny_dllm.generate is LLaDA's sampler (a fixed number of tokens per step); this is the other family,
which reveals each position at a random time. The README of lab/ measures the calls it saves.
"""
import torch

@torch.no_grad()
def generate_radd(model, prompts, gen_len, n_steps, temperature=0.0, generator=None, cache=True):
    """Fill a completion of gen_len tokens by RADD's sampler: time runs from t = 1 (all MASK) to 0 in
    n_steps equal steps. Under the linear schedule a token is still masked at time t with probability t,
    so a position still masked at t is revealed by s = t - 1/N with probability (t - s) / t (1 at the
    last step): each position's reveal step is uniform over the N steps, independently, and a sequence
    may see steps at which nothing is revealed. A revealed token is drawn from the network's prediction
    for the current state (greedy at temperature 0), which does not depend on t.

    The cache: with no time input, the network's output for a sequence that has not changed is the one it
    already computed. With cache=True a sequence goes to the network only at a step where it reveals
    something, and only if it changed since its last call; that is once per step with a reveal, c calls
    in all, E[c] = N (1 - (1 - 1/N)^L) (the first call, at the first reveal step, sees the all-MASK state;
    after the last reveal there is nothing left to predict). With cache=False every sequence is sent at
    every step until it is complete. The random draws are the same either way, so both give the same
    samples. Returns (completions (B, L), network calls per sequence (B,))."""
    if not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps: expected a positive int, got {n_steps!r}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    B, P = prompts.shape
    mask_id, V = model.config.mask_id, model.config.vocab_size
    x = torch.cat([prompts, torch.full((B, gen_len), mask_id, dtype=torch.long, device=prompts.device)], 1)
    logits = torch.zeros(B, gen_len, V, device=prompts.device, dtype=torch.float32)
    changed = torch.ones(B, dtype=torch.bool, device=prompts.device)               # since the last call
    calls = torch.zeros(B, dtype=torch.long)
    for n in range(n_steps):
        t, s = 1 - n / n_steps, 1 - (n + 1) / n_steps
        masked = x[:, P:] == mask_id
        reveal = (torch.rand(B, gen_len, generator=generator).to(x.device) < (t - s) / t) & masked
        uniform = torch.rand(B, gen_len, V, generator=generator).clamp(1e-10, 1 - 1e-10)
        gumbel = -torch.log(-torch.log(uniform))
        call = reveal.any(1) & changed if cache else masked.any(1)
        if call.any():
            logits[call] = model(x[call])[:, P:].float()
            calls += call.cpu()
            changed &= ~call
        x0 = (logits + temperature * gumbel.to(x.device)).argmax(-1) if temperature > 0 else logits.argmax(-1)
        x[:, P:] = torch.where(reveal, x0, x[:, P:])
        changed |= reveal.any(1)
    return x[:, P:], calls
