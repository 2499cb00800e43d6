"""
What each half of BGPO's update does to the likelihood of the completions it acts on, measured exactly.

Where A >= 0 the update raises the ELBO of a completion, a lower bound of log pi(y|x): the likelihood is
pushed up from below. Where A < 0 it lowers the ELBO, which guarantees nothing about the likelihood: the
ELBO is the mean over unmasking orders of each order's log-likelihood, log pi the log of the mean of their
likelihoods, so an update can lower the ELBO through orders that carry almost none of the probability.
SPG (Wang et al., arXiv 2510.09541) makes this argument. Completions of Countdown have L = 10 tokens, so the
lab can compute both exactly (lab/estimators.py, over the 2^L mask sets) and see what happens.

For each seed's SFT model and rollout batch (the first is the default RL run's first batch), one update on
the negative-advantage rows alone and, separately, one on the positive rows alone, each the first step of
the default optimizer (AdamW at --rl-lr, fresh moments, as RL step 1 takes) and a small one (--small-lr,
where the first-order picture holds). Measured on every completion of the first --groups groups that carry
a signal, before and after, per token (/ L):
- the random-order model's log-likelihood log E_sigma p_sigma(y|x), exactly;
- the ELBO, E_sigma log p_sigma(y|x), exactly; and the gap between them (>= 0, Jensen);
- how often the rollouts' sampler (LLaDA's low-confidence sampler at --temperature) writes the completion
  again, from --sampler-draws fresh draws of its prompt (the default step only: a small step's change is
  below that count's resolution).

    python -m lab.negatives [--seeds 0-2] [--batches 2] [--groups 4] [--sampler-draws 500] [any lab.rl flag]

Needs each seed's SFT model (python -m lab.rl --stage sft --seed S). Prints the table, mean over (seed,
batch) units with 95% Student-t intervals, and writes it to negatives.json in --out-dir.
"""
import argparse
import copy
import itertools
import json
import math
import os
import time

import torch

import bgpo
from lab import cli, rl
from lab.estimators import exact_table, random_order_from_table
from lab.objectives import ADVANTAGES, OBJECTIVES, rows_of
from lab.sampler import generate, sample_rollouts
from lab.sweep import interval, parse_seeds
from tasks import get_task

HALVES = {"negative": lambda A: A < 0, "positive": lambda A: A > 0}
MEASURES = ("log_likelihood", "elbo", "gap", "sampler_frequency")

# -----------------------------------------------------------------------------
# The three measures of a completion's likelihood

def exact_measures(model, prompts, completions):
    """Per row, exactly, in nats, from one enumeration of its 2^L mask sets (float64 model advised: the small
    step's changes are ~1e-5 nats): {"log_likelihood": log E_sigma p_sigma(y|x), "elbo": E_sigma log
    p_sigma(y|x), "gap": their difference}, each (B,)."""
    elbo, log_likelihood = zip(*(random_order_from_table(*exact_table(model, x, y)[:2])
                                 for x, y in zip(prompts, completions)))
    elbo, log_likelihood = torch.stack(elbo), torch.stack(log_likelihood)
    return {"log_likelihood": log_likelihood, "elbo": elbo, "gap": log_likelihood - elbo}

@torch.no_grad()
def sampler_frequency(model, prompts, completions, group_size, draws, args, generator, per_call=500):
    """Per row, the share of `draws` fresh samples from its prompt by the rollouts' sampler (lab.sampler's
    generate at --temperature, --gen-steps, --block-len) that equal the row's completion, and its standard
    error sqrt(f (1 - f) / draws): (B,), (B,). Rows come in groups of group_size completions of one prompt,
    which share the draws."""
    freq = []
    for g in range(0, len(prompts), group_size):
        hits = torch.zeros(group_size)
        for n in [per_call] * (draws // per_call) + ([draws % per_call] if draws % per_call else []):
            y = generate(model, prompts[g:g + 1].expand(n, -1), completions.shape[1], steps=args.gen_steps,
                         block_len=args.block_len, temperature=args.temperature, generator=generator)
            hits += (y[None] == completions[g:g + group_size, None]).all(-1).sum(1).cpu()   # (G,)
        freq.append(hits / draws)
    freq = torch.cat(freq).double()
    return freq, (freq * (1 - freq) / draws).sqrt()

def sampler_law(model, prompt, gen_len, temperature):
    """The exact law of lab.sampler.generate(model, prompt, gen_len, temperature=T) with its defaults (one
    token per step, one block, low-confidence remasking), by enumeration: at each step every masked position
    draws a token from softmax(logits / T), and the one whose drawn token is most probable under
    softmax(logits) is committed. -> {completion tuple: probability}. Sums over V^(masked positions) draws
    per state: tiny models and 2-3 tokens only (the test of sampler_frequency)."""
    mask_id, P = model.config.mask_id, prompt.shape[0]
    law = {}

    def visit(y, prob):
        masked = [i for i in range(gen_len) if y[i] == mask_id]
        if not masked:
            law[tuple(y)] = law.get(tuple(y), 0.0) + prob
            return
        with torch.no_grad():
            logits = model(torch.cat([prompt, torch.tensor(y)])[None]).double()[0, P:][masked]   # (m, V)
        q, p = (logits / temperature).softmax(-1), logits.softmax(-1)
        tokens = [(q[j] > 0).nonzero()[:, 0].tolist() for j in range(len(masked))]
        outcome = {}   # (position, token) committed -> probability
        for draw in itertools.product(*tokens):
            chance = math.prod(q[j, t].item() for j, t in enumerate(draw))
            j = max(range(len(masked)), key=lambda j: p[j, draw[j]].item())
            outcome[masked[j], draw[j]] = outcome.get((masked[j], draw[j]), 0.0) + chance
        for (i, t), chance in outcome.items():
            visit(y[:i] + [t] + y[i + 1:], prob * chance)

    visit([mask_id] * gen_len, 1.0)
    return law

# -----------------------------------------------------------------------------
# One half of the update, one step

def half_step(model, batch, state, A, half, lr, args):
    """A copy of model after one step of AdamW (fresh moments, lr, lab.rl's clip) on the rows of one half,
    their A scaled by their share of the batch, as lab.rl's split_by_sign does: the half's own part of the
    update's gradient."""
    rows = HALVES[half](A)
    stepped = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(stepped.parameters(), lr=lr, weight_decay=0.0)
    OBJECTIVES[args.objective].backward(stepped, rows_of(batch, rows), rows_of(state, rows),
                                        A[rows] * int(rows.sum()) / len(A), args, 0)
    torch.nn.utils.clip_grad_norm_(stepped.parameters(), 1.0)
    optimizer.step()
    return stepped

def measure(model, batch, rows, args, generator, sampler=True):
    """The measures of the completions in rows: the exact ones on a float64 copy, then the sampler's."""
    x, y = batch.x[rows].cpu(), batch.y[rows].cpu()
    result = exact_measures(copy.deepcopy(model).double().cpu(), x, y)
    if sampler:
        result["sampler_frequency"] = sampler_frequency(model, batch.x[rows], batch.y[rows], args.group_size,
                                                        args.sampler_draws, args, generator)[0]
    return result

def one_unit(model, task, args, generator):
    """One rollout batch of the SFT model: its rows, and per (half, step size) each measure's change on the
    rows of each sign."""
    G = args.group_size
    prompts = task.sample(args.prompts_per_step, "train", generator)[0]
    batch = sample_rollouts(model, task, prompts, G, args, generator)
    A = ADVANTAGES[args.advantages](batch.rewards, G).to(args.device)
    A = torch.where(A < 0, args.neg_weight * A, A)
    state = OBJECTIVES[args.objective].prepare(model, batch, args, generator)
    signal = (A.view(-1, G) != 0).any(1).nonzero()[:, 0][:args.groups]   # the first groups with a signal
    rows = (signal[:, None] * G + torch.arange(G, device=signal.device)).flatten()
    sign = A[rows].sign().cpu()
    draw_seed = int(torch.randint(2**31, (1,), generator=generator))
    freq_gen = lambda: torch.Generator().manual_seed(draw_seed)   # the same draws before and after
    if not len(rows):
        return None
    before = measure(model, batch, rows, args, freq_gen())
    changes = {}
    for half, (size, lr) in itertools.product(HALVES, (("default", args.rl_lr), ("small", args.small_lr))):
        if not HALVES[half](A).any():
            continue
        after = measure(half_step(model, batch, state, A, half, lr, args), batch, rows, args, freq_gen(),
                        sampler=size == "default")
        changes[half, size] = {name: after[name] - before[name] for name in after}
    return {"rows": len(rows), "groups": len(signal), "sign": sign, "before": before, "changes": changes,
            "solved": batch.rewards[rows.cpu()]}

def summarise(units, L):
    """Per (half, step, rows of a sign, measure): the mean over units of each unit's mean change per token,
    with its interval; the share of rows whose measure fell (pooled over units). The sampler frequency's
    change is per completion, not per token."""
    table, updates = [], sorted({key for unit in units for key in unit["changes"]})
    for (half, size), on, name in itertools.product(updates, ("negative", "positive"), MEASURES):
        per_unit, fell, n = [], 0, 0
        for unit in units:
            rows = unit["sign"] < 0 if on == "negative" else unit["sign"] > 0
            if name not in unit["changes"].get((half, size), {}):
                continue
            change = unit["changes"][half, size][name][rows]
            change = change if name == "sampler_frequency" else change / L
            if len(change):
                per_unit.append(change.mean().item())
                fell, n = fell + int((change < 0).sum()), n + len(change)
        if not per_unit:
            continue
        mean, half_width = interval(per_unit)
        table.append({"update": half, "step": size, "rows": on, "measure": name, "mean": mean,
                      "half_width": half_width, "share_fell": fell / n, "n": n, "units": len(per_unit)})
    return table

def main(argv=None):
    p = cli.make_parser("python -m lab.negatives", __doc__.strip().split("\n")[0])
    a = p.add_argument
    a("--seeds", type=parse_seeds, default=parse_seeds("0-2"), help="seeds, e.g. 0-2 or 0,3")
    a("--batches", type=int, default=2, help="rollout batches per seed, drawn from its SFT model")
    a("--groups", type=int, default=4, help="groups with a signal measured per batch (L=10: ~1 s per row)")
    a("--sampler-draws", type=int, default=500, help="fresh samples per prompt for the sampler's frequency")
    a("--small-lr", type=float, default=1e-6, help="the learning rate of the small step")
    a("--advantages", choices=list(ADVANTAGES), default="group", help="as lab.rl's")
    a("--objective", choices=["bgpo"], default="bgpo", help="the update measured")
    args = p.parse_args(argv)
    for flag in ("batches", "groups", "sampler_draws"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.small_lr) and args.small_lr > 0):
        p.error(f"--small-lr must be positive, got {args.small_lr}")
    task, units, t0 = get_task(args.task), [], time.time()
    for seed in args.seeds:
        seeded = cli.check_args(p, argparse.Namespace(**{**vars(args), "seed": seed}))
        path = rl.sft_path(seeded)
        if not os.path.isfile(path):
            raise bgpo.RunError(f"no SFT model at {path} (python -m lab.rl --stage sft --seed {seed})")
        model = bgpo.load_model(path, task, seeded)
        generator = torch.Generator().manual_seed(seed + 1)   # lab.rl's: batch 1 is its first rollout batch
        for b in range(args.batches):
            unit = one_unit(model, task, seeded, generator)
            if unit is None:
                print(f"seed {seed} batch {b + 1}: no group with a signal (every group's rewards tie)")
                continue
            units.append(unit)
            signs = unit["sign"]
            print(f"seed {seed} batch {b + 1}: {unit['groups']} groups, {unit['rows']} completions "
                  f"({int((signs < 0).sum())} negative, {int((signs > 0).sum())} positive) | "
                  f"{time.time() - t0:.0f} s")
    if not units:
        raise bgpo.RunError("no rollout batch had a group with a signal: nothing to measure")
    table = summarise(units, task.gen_len)
    print(f"\nchange per token (nats) of the completions' likelihood after one step on one half of the "
          f"update, mean over {len(units)} (seed, batch) units [95% interval]; share: of the rows, pooled, "
          f"whose value fell\nsampler: change of the frequency with which the sampler writes the completion, "
          f"from {args.sampler_draws} draws of its prompt\n")
    print(f"{'update':<10}{'step':<9}{'rows':<10}{'measure':<18}{'mean change':>24}{'share fell':>12}")
    for r in table:
        value = f"{r['mean']:+.2e} [{r['mean'] - r['half_width']:+.1e}, {r['mean'] + r['half_width']:+.1e}]"
        print(f"{r['update']:<10}{r['step']:<9}{r['rows']:<10}{r['measure']:<18}{value:>24}"
              f"{r['share_fell']:>12.2f}")
    cli.write_json(os.path.join(args.out_dir, "negatives.json"),
                   {"seeds": args.seeds, "batches": args.batches, "groups": args.groups,
                    "sampler_draws": args.sampler_draws, "rl_lr": args.rl_lr, "small_lr": args.small_lr,
                    "table": table})
    return table

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.negatives")
