"""
One BGPO update and the policy's entropy, on this model: how much the update lowers it and which of the
update's terms do (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv 2505.22617, measured in a masked diffusion LM).

    python -m lab.entropy_mechanism [--seed S] [--lr 0.001] [--prompts 200] [--checkpoint CKPT] [flags]

H is the mean entropy of the denoiser's predictions at the masked positions of test prompts with the whole
completion masked (the sampler's first step, lab.rl's eval_entropy). For a softmax p = softmax(z) at one
position, dH/dz_v = -p_v (log p_v + H), so a change dz of the logits changes H by about

    dH = -Cov_{v ~ p}(log p_v, dz_v)        (Cui et al.'s lemma, here exact to first order)

On-policy, BGPO's gradient is a sum of terms, one per row b, copy j and masked position i: A_b w_bj grad log
p(y^i | copy j) / (n_t L B). The command takes one rollout batch of the SFT model of --seed (or of the RL
checkpoint --checkpoint names; bgpo.py's rollouts, advantages with negative ones halved, n_t copies), splits
those terms four ways, A > 0 or A < 0 times confident or rare (log p of the written token above or below the
median over the terms), and for the whole update and each part takes one plain gradient step of --lr from that
model: the entropy change it measures (per unit of --lr), and the first-order prediction -Cov(log p, dz) from
the step's own change of the logits. Steps are plain gradient steps, not AdamW's, so that the parts add up.
"""
import copy

import torch

import bgpo
from lab import cli
from lab.estimators import token_log_probs
from lab.objectives import flat_grad
from lab.rl import entropy, first_step_logits
from tasks import encode, get_task

def first_order_change(logits, new_logits):
    """-Cov_{v ~ p}(log p_v, dz_v) per position, p = softmax(logits), dz = new_logits - logits: (...,)."""
    logq = logits.log_softmax(-1)
    p, log_p = logq.exp(), logq.nan_to_num(0.0)
    dz = (new_logits - logits).nan_to_num(0.0)   # -inf - (-inf) at MASK: nan, where p = 0
    return -((p * log_p * dz).sum(-1) - (p * log_p).sum(-1) * (p * dz).sum(-1))

def term_gradient(model, prompts, completions, mc, A, keep):
    """The on-policy BGPO gradient of the kept terms alone, as a flat vector: the gradient of
        -sum_{(b, j, i) kept} A_b w_bj log p(y_b^i | copy j) / (n_t L B),
    keep (B, M, L) bool within mc.mask; one copy per backward, as bgpo_backward. Disjoint parts add up."""
    (B, M, L) = mc.mask.shape
    model.zero_grad(set_to_none=True)
    for j in range(M):
        logp = token_log_probs(model, prompts, completions, mc.mask[:, j])                    # (B, L)
        weight = A[:, None] * mc.weight[:, j:j + 1].to(logp) * keep[:, j]
        (-(weight * logp).sum() / (M * L * B)).backward()
    return flat_grad(model)

def parts_of(model, prompts, completions, mc, A):
    """The four parts of the update's terms: {name: (B, M, L) bool}, masked positions of rows with A != 0."""
    with torch.no_grad():
        logp = torch.stack([token_log_probs(model, prompts, completions, mc.mask[:, j])
                            for j in range(mc.mask.shape[1])], 1)                              # (B, M, L)
    terms = mc.mask & (A != 0)[:, None, None]
    median = logp[terms].median() if terms.any() else 0.0
    confident = logp > median
    positive = (A > 0)[:, None, None]
    return {"A > 0, confident": terms & positive & confident, "A > 0, rare": terms & positive & ~confident,
            "A < 0, confident": terms & ~positive & confident, "A < 0, rare": terms & ~positive & ~confident}

def stepped(model, direction, lr):
    """A copy of model moved by -lr * direction (a flat vector in parameters() order)."""
    moved = copy.deepcopy(model)
    with torch.no_grad():
        offset = 0
        for p in moved.parameters():
            p -= lr * direction[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    return moved

def measure(model, x, y, mc, A, held_out, gen_len, lr):
    """For the whole update and each part: (share of the terms, measured dH / lr, first-order dH / lr)."""
    with torch.no_grad():
        logits = first_step_logits(model, held_out, gen_len)
        H = entropy(logits).mean().item()
    parts = {"whole update": mc.mask & (A != 0)[:, None, None], **parts_of(model, x, y, mc, A)}
    rows = {}
    for name, keep in parts.items():
        moved = stepped(model, term_gradient(model, x, y, mc, A, keep), lr)
        with torch.no_grad():
            new_logits = first_step_logits(moved, held_out, gen_len)
            measured = (entropy(new_logits).mean().item() - H) / lr
            predicted = first_order_change(logits, new_logits).mean().item() / lr
        rows[name] = (keep.sum().item() / max(parts["whole update"].sum().item(), 1), measured, predicted)
    return H, rows

def main(argv=None):
    p = cli.make_parser("python -m lab.entropy_mechanism", __doc__.strip().split("\n\n")[0])
    p.add_argument("--lr", type=float, default=0.001, help="the plain gradient step's size")
    p.add_argument("--prompts", type=int, default=200, help="test prompts whose entropy is measured")
    p.add_argument("--checkpoint", default=None,
                   help="an RL run's ckpt.pt, measured instead of the SFT model, on its own rollouts")
    args = cli.check_args(p, p.parse_args(argv))
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    task = get_task(args.task)
    model = (bgpo.load_model(args.checkpoint, task, args) if args.checkpoint
             else bgpo.sft_model(args, task))   # loaded, or trained first if out/ lacks it
    generator = torch.Generator().manual_seed(args.seed + 1)        # bgpo.run_rl's first rollout batch
    G, B = args.group_size, args.prompts_per_step * args.group_size
    prompts = task.sample(B // G, "train", generator)[0]
    x, y, rewards = bgpo.sample_rollouts(model, task, prompts, args, generator)
    A = bgpo.group_advantages(rewards, G).to(args.device)
    A = torch.where(A < 0, args.neg_weight * A, A)
    mc = bgpo.draw_mc_samples(B, task.gen_len, args.mc_samples, generator).to(args.device)
    held_out = encode(task, bgpo.test_problems(task, args)[:args.prompts], device=args.device)
    H, rows = measure(model, x, y, mc, A, held_out, task.gen_len, args.lr)
    where = f"seed {args.seed}" + (f", {args.checkpoint}" if args.checkpoint else "")
    print(f"{task.name}, {where}: entropy {H:.4f} nats per masked position on {len(held_out)} test "
          f"prompts; one rollout batch ({int((A != 0).sum())} of {B} rows with A != 0), a plain step of "
          f"{args.lr}")
    print(f"{'terms':<18} {'share':>6} {'dH / lr measured':>17} {'-Cov(log p, dz) / lr':>21}")
    for name, (share, measured, predicted) in rows.items():
        print(f"{name:<18} {share:>6.1%} {measured:>+17.4f} {predicted:>+21.4f}")
    return H, rows

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.entropy_mechanism")
