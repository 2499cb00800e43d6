"""
The lab's sampler: tiny_dllm.generate (LLaDA's) with the options the lab's experiments need, and the
lab's rollouts and greedy evaluation, which use it.

- remasking="random": commit positions of the block chosen uniformly instead of the most confident
  ones (LLaDA's other option). The order then does not depend on the model, and with one token per
  step it samples from the random-order model whose likelihood lab.estimators.random_order_log_likelihood
  computes.
- STP's two prunings (Liu et al. 2026), both off by default:
  prior (B, L): token ids, mask_id where free. The other tokens (anchors) are in place from the start,
    are never changed, and keep commit step -1; each row spreads its own free positions over the
    block's steps, and a step at which no row commits anything needs no forward pass.
  early_stop tau: a row stops committing once int(tau * gen_len) of its tokens are in place (anchors
    included); when every row has stopped, one more forward pass fills every position still masked
    with its sampled token, all committed at that last step.
With none of them it gives generate's completions, draw for draw (a test checks it). The four helpers
below copy tiny_dllm.generate's logic: its argument checks, its token schedule and its sampling.
sample_rollouts and evaluate copy bgpo.py's, with the lab's --temperature, --gen-steps and --block-len
and the sampler's options; with the tutorial's settings they give bgpo.py's rollouts and evaluations
(a test checks it).
"""
import math
from dataclasses import dataclass

import torch

from tasks import encode

def steps_per_block(steps, num_blocks):
    return [steps // num_blocks + (b < steps % num_blocks) for b in range(num_blocks)]

def tokens_per_step(block_size, steps):
    """As even as possible: block_size tokens over `steps` steps, the larger counts first."""
    return [block_size // steps + (s < block_size % steps) for s in range(steps)]

def sample_tokens(logits, temperature, generator=None):
    """A token per position: argmax at temperature 0, else a sample of softmax(logits / temperature) by the
    Gumbel-max trick. The noise is drawn on the CPU, so a seed gives the same tokens on every device."""
    if temperature == 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, generator=generator).clamp(1e-10, 1 - 1e-10)
    gumbel = -torch.log(-torch.log(u)).to(logits.device)
    return (logits + temperature * gumbel).argmax(-1)

def check_sampler_args(gen_len, steps, block_len, temperature):
    """generate's defaults filled in and checked: (steps, block_len, number of blocks)."""
    steps = gen_len if steps is None else steps
    block_len = gen_len if block_len is None else block_len
    if not 1 <= block_len <= gen_len:
        raise ValueError(f"block_len: expected 1..{gen_len}, got {block_len}")
    num_blocks = math.ceil(gen_len / block_len)
    if not num_blocks <= steps <= gen_len:
        raise ValueError(f"steps: expected {num_blocks}..{gen_len} (at least one per block), got {steps}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    return steps, block_len, num_blocks

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

# -----------------------------------------------------------------------------
# The lab's rollouts and greedy evaluation

@dataclass
class Rollouts:
    """B = prompts x G completions from the policy, with what the sampler and the verifier said."""
    prompts: list               # B prompt strings, each repeated G times in a row
    x: torch.Tensor             # (B, P) prompt tokens
    y: torch.Tensor             # (B, L) completions
    commit_steps: torch.Tensor  # (B, L) the sampler step that wrote each token
    texts: list                 # B decoded completions
    rewards: torch.Tensor       # (B,)

@torch.no_grad()
def sample_rollouts(model, task, prompts, group_size, args, generator, **options):
    """A copy of bgpo.sample_rollouts: G = group_size completions of each prompt from the current policy
    at --temperature (with --gen-steps, --block-len and generate's options: remasking, prior, early_stop),
    and the verifier's rewards, kept with their commit steps and texts as Rollouts."""
    prompts = [p for p in prompts for _ in range(group_size)]
    x = encode(task, prompts, device=args.device)
    y, commit_steps = generate(model, x, task.gen_len, steps=args.gen_steps, block_len=args.block_len,
                               temperature=args.temperature, generator=generator, return_steps=True,
                               **options)
    texts = [task.decode(ids) for ids in y.cpu()]
    rewards = torch.tensor([task.reward(p, t) for p, t in zip(prompts, texts)])
    return Rollouts(prompts, x, y, commit_steps, texts, rewards)

@torch.no_grad()
def evaluate(model, task, prompts, args, n_show=3):
    """A copy of bgpo.evaluate, with --gen-steps and --block-len: greedy decoding, exact-solve rate
    (reward 1), mean reward, and n_show prompt -> completion lines (the first solved, if any, and the first
    unsolved ones)."""
    batch_size = len(prompts) if args.device.startswith("cuda") else 256  # CPU: the sizes the README ran
    texts = [task.decode(y) for i in range(0, len(prompts), batch_size)
             for y in generate(model, encode(task, prompts[i:i + batch_size], device=args.device),
                               task.gen_len, steps=args.gen_steps, block_len=args.block_len).cpu()]
    rewards = [task.reward(prompt, text) for prompt, text in zip(prompts, texts)]
    solved = [int(r == 1.0) for r in rewards]   # per problem, in order
    first = [i for i, s in enumerate(solved) if s][:1]
    shown = sorted(first + [i for i, s in enumerate(solved) if not s][:n_show - len(first)])
    return {"accuracy": sum(solved) / len(solved), "reward": sum(rewards) / len(rewards), "solved": solved,
            "examples": [f"    {prompts[i]} -> {texts[i]} -> reward {rewards[i]:.2f}" for i in shown]}
