"""
The lab's sampler: tiny_dllm.generate (LLaDA's) with the options the lab's experiments need.

- remasking="random": commit positions of the block chosen uniformly instead of the most confident
  ones (LLaDA's other option). The order then does not depend on the model, and with one token per
  step it samples from the random-order model whose likelihood bgpo.random_order_log_likelihood computes.
- STP's two prunings (Liu et al. 2026), both off by default:
  prior (B, L): token ids, mask_id where free. The other tokens (anchors) are in place from the start,
    are never changed, and keep commit step -1; each row spreads its own free positions over the
    block's steps, and a step at which no row commits anything needs no forward pass.
  early_stop tau: a row stops committing once int(tau * gen_len) of its tokens are in place (anchors
    included); when every row has stopped, one more forward pass fills every position still masked
    with its sampled token, all committed at that last step.
With none of them it gives generate's completions, draw for draw.
"""
import torch

from tiny_dllm import check_sampler_args, sample_tokens, steps_per_block, tokens_per_step

@torch.no_grad()
def generate(model, prompts, gen_len, steps=None, block_len=None, temperature=0.0, generator=None,
             return_steps=False, remasking="low_confidence", prior=None, early_stop=None):
    steps, block_len, num_blocks = check_sampler_args(gen_len, steps, block_len, temperature)
    if remasking not in ("low_confidence", "random"):
        raise ValueError(f"remasking: expected 'low_confidence' or 'random', got {remasking!r}")
    if prior is not None and tuple(prior.shape) != (prompts.shape[0], gen_len):
        raise ValueError(f"prior: expected ({prompts.shape[0]}, {gen_len}), got {tuple(prior.shape)}")
    if early_stop is not None and not 0 < early_stop <= 1:
        raise ValueError(f"early_stop: expected a fraction in (0, 1], got {early_stop!r}")
    B, P = prompts.shape
    mask_id = model.config.mask_id
    completion = torch.full((B, gen_len), mask_id, dtype=torch.long) if prior is None else prior
    x = torch.cat([prompts, completion.to(prompts.device)], 1)
    committed_at = torch.full((B, gen_len), -1, dtype=torch.long, device=prompts.device)
    budget = int(early_stop * gen_len) if early_stop else gen_len      # tokens in place before the early stop
    step = 0

    def predict():
        logits = model(x).float()                                        # (B, T, V)
        return logits, sample_tokens(logits, temperature, generator)

    for b, block_steps in enumerate(steps_per_block(steps, num_blocks)):
        lo, hi = P + b * block_len, P + min((b + 1) * block_len, gen_len)
        # per row; all hi - lo without a prior
        free = (x[:, lo:hi] == mask_id).sum(1).tolist()
        counts = torch.tensor([tokens_per_step(f, block_steps) for f in free], device=x.device)  # (B, steps)
        for s in range(block_steps):
            placed = (x[:, P:] != mask_id).sum(1)
            k = counts[:, s].masked_fill(placed >= budget, 0)            # tokens each row commits now
            if not k.any():
                continue                                                 # nothing to commit: no forward pass
            logits, x0 = predict()
            confidence = logits.softmax(-1).gather(-1, x0[..., None])[..., 0]  # (B, T)
            if remasking == "random":
                confidence = torch.rand(confidence.shape, generator=generator).to(confidence.device)
            candidate = x == mask_id
            candidate[:, :lo] = False
            candidate[:, hi:] = False                                    # only the current block
            confidence = confidence.masked_fill(~candidate, -1.0)
            chosen = confidence.topk(int(k.max()), dim=1).indices        # (B, k_max), most confident first
            row = torch.arange(B, device=x.device)[:, None].expand_as(chosen)
            keep = torch.arange(chosen.shape[1], device=x.device) < k[:, None]  # each row's own k
            row, chosen = row[keep], chosen[keep]
            x[row, chosen] = x0[row, chosen]
            committed_at[row, chosen - P] = step
            step += 1
    if early_stop and (x[:, P:] == mask_id).any():                       # one pass fills the rest
        _, x0 = predict()
        rest = x == mask_id
        x[rest] = x0[rest]
        committed_at[rest[:, P:]] = step
    completions = x[:, P:]
    return (completions, committed_at) if return_steps else completions
