"""
How far off-policy the paper's second mini-batch is, and how far each objective's gradient there is
from the exact naive gradient: the measured cause behind the lemma ablation's result.

    python -m lab.offpolicy [the RL run's flags] [--from-sft] [--batches N]

From an RL run's checkpoint (its weights and its AdamW state; the SFT model and a fresh AdamW with
--from-sft), for each of N fresh rollout batches split as the paper's off-policy scheme splits them, in two
mini-batches: the first mini-batch's update, as bgpo.run_rl makes it (--objective), then, on the second
mini-batch, the log-ratios d_j that update sees and the gradient of each objective (the naive one in one
graph and in two passes, BGPO, each lemma alone) against the naive one: relative difference and cosine.
The flags name the run as bgpo.py names it: with none, the run of a default `python bgpo.py`,
out/countdown_bgpo_nt8_seed0/ckpt.pt; with --minibatches 2 (and the ablation's flags), that run. The
measurement is two mini-batches whatever --minibatches is. Nothing is written; the checkpoint is untouched.
"""
import copy
import statistics

import torch

import bgpo
from bgpo import (MCSamples, draw_mc_samples, elbo_terms, group_advantages, load_checkpoint, load_model,
                  ppo_clip, sft_path)
from lab import cli
from lab.objectives import bound_backward, flat_grad, lemma1_bound, lemma2_bound, naive_two_pass_backward
from lab.sampler import sample_rollouts
from tasks import get_task

def gradients(model, x, y, mc, old_terms, A, clip_eps):
    """Each objective's gradient on one mini-batch: name -> flat vector."""
    def naive_one_graph(*inputs):
        bgpo.naive_loss(*inputs).backward()

    updates = {"naive (one graph)": naive_one_graph, "naive (two passes)": naive_two_pass_backward,
               "BGPO": bgpo.bgpo_backward,
               "Lemma 1 only": lambda *inputs: bound_backward(*inputs[:-1], lemma1_bound, inputs[-1]),
               "Lemma 2 only": lambda *inputs: bound_backward(*inputs[:-1], lemma2_bound, inputs[-1])}
    grads = {}
    for name, update in updates.items():
        model.zero_grad(set_to_none=True)
        update(model, x, y, mc, old_terms, A, clip_eps)
        grads[name] = flat_grad(model)
    return grads

def measure(args, task, model, optimizer_state, generator):
    """One rollout batch: the first mini-batch's update, then the second mini-batch's d_j and gradients."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    G, B = args.group_size, args.group_size * args.prompts_per_step
    batch = sample_rollouts(model, task, task.sample(args.prompts_per_step, "train", generator)[0], G, args,
                            generator)
    A = group_advantages(batch.rewards, G).to(args.device)
    A = torch.where(A < 0, args.neg_weight * A, A)
    mc = draw_mc_samples(B, task.gen_len, args.mc_samples, generator).to(args.device)
    with torch.no_grad():
        old_terms = elbo_terms(model, batch.x, batch.y, mc)                          # (B, M)
    # each mini-batch's informative rows, their A scaled by their share of its rows (as bgpo.run_rl's update)
    first, second = (rows[A[rows] != 0] for rows in torch.arange(B, device=A.device).chunk(2))
    if len(first) == 0 or len(second) == 0:                   # a mini-batch of tied groups: no update
        return None
    inputs = (batch.x[first], batch.y[first], MCSamples(mc.mask[first], mc.weight[first]), old_terms[first],
              A[first] * (len(first) / (B // 2)), args.clip_eps)
    optimizer.zero_grad(set_to_none=True)
    if args.objective == "bgpo":
        bgpo.bgpo_backward(model, *inputs, args.mc_chunk)
    else:
        bgpo.naive_loss(model, *inputs).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    x, y, old_terms = batch.x[second], batch.y[second], old_terms[second]
    mc, A = MCSamples(mc.mask[second], mc.weight[second]), A[second] * (len(second) / (B - B // 2))
    with torch.no_grad():
        d = (elbo_terms(model, x, y, mc) - old_terms) / y.shape[1]                  # (B/2, M)
        ratio = d.mean(1).exp()
        clipped = (ppo_clip(ratio, A, args.clip_eps) < ratio * A).double().mean().item()  # the naive's
    grads = gradients(model, x, y, mc, old_terms, A, args.clip_eps)
    grads = {name: g.double() for name, g in grads.items()}
    naive = grads["naive (one graph)"]
    result = {"mean |d|": d.abs().mean().item(), "max |d|": d.abs().max().item(),
              "max |ratio - 1|": (ratio - 1).abs().max().item(), "share clipped": clipped}
    for name, g in grads.items():
        result[name] = ((g - naive).norm() / naive.norm()).item(), torch.cosine_similarity(g, naive, 0).item()
    return result

def parse_args(argv=None):
    p = cli.make_parser("python -m lab.offpolicy",
                        "How far off-policy the second mini-batch is, and each objective's gradient there.")
    p.add_argument("--batches", type=int, default=5, help="rollout batches measured")
    p.add_argument("--from-sft", action="store_true",
                   help="start from the SFT model and a fresh AdamW instead of the RL run's checkpoint")
    args = cli.check_args(p, p.parse_args(argv))
    if args.batches < 1:
        p.error(f"--batches must be a positive integer, got {args.batches}")
    if args.prompts_per_step % 2:
        p.error(f"--prompts-per-step {args.prompts_per_step} must be even: two mini-batches of whole groups")
    return args

def main(argv=None):
    args = parse_args(argv)
    task = get_task(args.task)
    if args.from_sft:
        model, optimizer_state, source = load_model(sft_path(args), task, args), None, sft_path(args)
    else:
        source = f"{args.out_dir}/{args.run_name}/ckpt.pt"
        state = load_checkpoint(source, task)
        model = load_model(sft_path(args), task, args)
        model.load_state_dict(state["model"])
        optimizer_state, source = state["optimizer"], f"{source} (step {state['step']})"
    generator = torch.Generator().manual_seed(args.seed + 3)
    results = [measure(args, task, model, optimizer_state, generator) for _ in range(args.batches)]
    results = [r for r in results if r is not None]                       # None: the second half tied
    print(f"{source}: the second mini-batch of {len(results)} rollout batches, after the first's update "
          f"(lr {args.rl_lr:g}, clip {args.clip_eps:g}, n_t = {args.mc_samples})")
    for key in ("mean |d|", "max |d|", "max |ratio - 1|", "share clipped"):
        print(f"  {key:>18}: " + " ".join(f"{r[key]:.2e}" for r in results))
    print(f"  {'gradient':>18}  relative difference from the naive gradient (median) | cosine (median)")
    for name in ("naive (one graph)", "naive (two passes)", "BGPO", "Lemma 1 only", "Lemma 2 only"):
        rel = statistics.median(r[name][0] for r in results)
        cos = statistics.median(r[name][1] for r in results)
        print(f"  {name:>18}: {rel:.2e} | {cos:.6f}")
    return results

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.offpolicy")
