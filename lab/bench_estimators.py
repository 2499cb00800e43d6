"""
Every likelihood estimator of lab/estimators.py measured against exact enumeration, on the SFT
model's own rollouts: the BGPO paper's Fig. 3, in small.

    python -m lab.bench_estimators [--task T] [--plot] [any bgpo.py or lab flag for the model and sampler]

1. The likelihood table: each estimator's exact bias (against the ELBO and the log random-order
   likelihood) and standard deviation for n = 1..64 draws, with its forward passes.
2. The gradient table (Fig. 3): for each RL objective and n_t, 8 recomputations of its on-policy
   gradient against the objective's own exact expected gradient and the exact ELBO gradient, with
   the activation memory of one update.
3. Signal to noise (Countdown, arithmetic): is RL limited by MC noise or by rollout noise?
4. The ELBO as a policy gradient: for random-remasking rollouts the exact policy gradient is known.
It writes out/estimators_TASK.json and, with --plot, the Fig. 3 PNG. The SFT model is trained
first if out/ has no matching checkpoint.
"""
import contextlib
import json
import math
import os
import time

import numpy as np
import torch

import bgpo
from bgpo import RunError, bgpo_backward, draw_mc_samples, elbo_terms, group_advantages, naive_loss
from lab import cli
from lab.estimators import (anchored_elbo, antithetic_moments, average_of_draws, count_form_moments,
                            diffucoder_moments, dtrpo_log_likelihood, elbo_from_table, exact_elbo,
                            exact_table, log_probs_under_every_mask, one_step_log_likelihood,
                            one_step_prompt_mask_moments, random_order_from_table, size_stats,
                            stp_log_likelihood, stratified_moments, sudoku_anchors,
                            trajectory_log_likelihood, trajectory_moments)
from lab.figures import draw
from lab.objectives import flat_grad
from lab.sampler import sample_rollouts
from tasks import get_task
from tiny_dllm import ActivationMemory

N_T = (1, 2, 4, 8, 16, 32, 64)
MAX_PROMPT_MASKED = 14                   # d1's prompt masking is enumerated up to 2^14 prompt masks
REPEATS = 8                              # recomputations per gradient, as in the paper's Fig. 3

def lab_batch(task):
    """A fixed batch of 4 prompts x G = 8 rollouts; 2 x 2 on Sudoku, whose 2^16 mask sets per
    sequence take about a minute each with the default model on 2 CPU cores."""
    return (4, 8) if task.gen_len <= 12 else (2, 2)

def _rollouts(model, task, prompts, args, seed, remasking="low_confidence"):
    """The SFT model's G rollouts of each prompt, from their own generator:
    (x, y, commit_steps, A, rewards)."""
    G = lab_batch(task)[1]
    batch = sample_rollouts(model, task, prompts, G, args, torch.Generator().manual_seed(seed),
                            remasking=remasking)
    return (batch.x, batch.y, batch.commit_steps, group_advantages(batch.rewards, G).to(args.device),
            batch.rewards)

def _gradient(model, run, measure=False):
    """Runs one objective's forward and backward; returns the flat gradient and, if measure, the peak
    MB autograd held (ActivationMemory's hooks cost time, so only when asked)."""
    model.zero_grad(set_to_none=True)
    with ActivationMemory(model) if measure else contextlib.nullcontext() as memory:
        run()
    return flat_grad(model).double().cpu(), memory.peak / 2**20 if measure else None

def _surrogate(A, L, estimate):
    """On-policy, every objective of the family has the gradient of -mean_b A_b X_b / L, with X the
    method's log-likelihood estimate (for BGPO and the naive objective, X is the MC estimate of the ELBO)."""
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
            elbo = exact_elbo(model, x[b], y[b])
            (-A[b].to(elbo) / (B * L) * elbo).backward()
    return run

def likelihood_table(model, x, y, commit, block_len, group, anchors=None, prompt_mask_prob=0.15):
    """Exact mean and variance of every estimator, per sequence; the two reference values (the ELBO and
    the log random-order likelihood); and the variance between mask counts of one count-form draw."""
    B, L = y.shape
    rows = {}
    # var: of one draw, or a function of n
    def add(name, fwd, mean, var):
        rows.setdefault(name, {"fwd": fwd, "mean": [], "var": []})
        rows[name]["mean"].append(float(mean))
        rows[name]["var"].append([float(var(n)) if callable(var) else float(var) / n for n in N_T])
    elbo, ro, between = [], [], []
    for b in range(B):
        masks, logp, a, full = exact_table(model, x[b], y[b])
        elbo.append(float(elbo_from_table(masks, logp)))
        ro.append(float(random_order_from_table(masks, logp)[1]))
        stats = size_stats(a, L)
        weighted_means = torch.stack([L / k * m for k, (m, v) in enumerate(stats, 1)])
        between.append(float(weighted_means.var(unbiased=False)))
        add("ELBO, iid 1/t", "n", elbo[-1], float("inf"))
        add("ELBO, stratified (BGPO)", "n", elbo[-1], lambda n: stratified_moments(stats, n)[1])
        add("antithetic pair (ours)", "2n", *antithetic_moments(a, L))
        mean_field = full[-1].sum()
        add("DiffuCoder coupled", "3n", *diffucoder_moments(a, mean_field, L))
        add("one-step, no prompt mask", "1", mean_field, 0.0)
        K = int(commit[b].max()) + 1
        add("trajectory, all steps", str(K), *trajectory_moments(full, commit[b].cpu(), L)[:1], 0.0)
        nb = math.ceil(L / block_len)
        add("dTRPO, 1 step per block", f"{nb}n" if nb > 1 else "n",
            *trajectory_moments(full, commit[b].cpu(), block_len))
        if anchors is not None:
            add("count form, no anchors", "n", *count_form_moments(stats))
            add("STP, anchors never masked", "n", *count_form_moments(size_stats(a, L, ~anchors[b])))
    if x.shape[1] <= MAX_PROMPT_MASKED:                                             # 2^P prompt masks
        # a group shares its prompt
        for b in range(0, B, group):
            with torch.no_grad():
                mean, var = one_step_prompt_mask_moments(model, x[b], y[b:b + group], prompt_mask_prob)
            for m, v in zip(mean.tolist(), var.tolist()):
                add(f"one-step, prompt mask {prompt_mask_prob} (d1)", "n", m, v)
    return elbo, ro, rows, between

def print_likelihood_table(elbo, ro, rows, between):
    print(f"\n1. Likelihood estimators, exact by enumeration ({len(elbo)} sequences;"
          f" mean ELBO {np.mean(elbo):.3f} nats, mean log random-order likelihood {np.mean(ro):.3f})")
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
    print(f"Of one count-form draw's variance ({one_draw:.2f} nats^2, mean over sequences),"
          f" {np.mean(between):.2f} is between mask counts (the spread of the L/k-weighted means),"
          " which stratification removes.")

def gradient_table(model, x, y, commit, A, block_len, group, anchors=None, prompt_mask_prob=0.15):
    """The Fig. 3 analogue, on-policy with fixed advantages: for each objective and n_t, REPEATS
    gradients with fresh draws, compared with the objective's own exact expected gradient and with
    the exact ELBO gradient."""
    B, L = y.shape
    live = (A != 0).nonzero()[:, 0].tolist()                                        # A = 0 adds nothing
    scale = -A.to(torch.get_default_dtype()) / (B * L)

    def own_one_step():
        for b in range(0, B, group):
            one_step_prompt_mask_moments(model, x[b], y[b:b + group], prompt_mask_prob,
                                         weights=scale[b:b + group])

    def own_stp():
        for b in live:
            (scale[b] * anchored_elbo(model, x[b], y[b], ~anchors[b])).backward()

    objectives = {}  # name -> (run for n draws and a generator, own exact expected gradient's run)
    # 2^L mask sets per sequence
    if anchors is None:
        golden = _exact_elbo_run(model, x, y, A)
        objectives["BGPO = naive (ELBO)"] = (lambda n, generator: _bgpo_run(model, x, y, A, n, generator),
                                             golden)
        if x.shape[1] <= MAX_PROMPT_MASKED:
            objectives[f"diffu-GRPO (p = {prompt_mask_prob})"] = (
                lambda n, generator: _surrogate(A, L, lambda: average_of_draws(
                    one_step_log_likelihood, n, model, x, y, prompt_mask_prob=prompt_mask_prob,
                    generator=generator)),
                own_one_step)
    else:
        golden = None
        objectives["STP (anchored ELBO)"] = (lambda n, generator: _surrogate(A, L, lambda: average_of_draws(
            stp_log_likelihood, n, model, x, y, anchors, generator=generator)), own_stp)
    objectives["dTRPO (1 step per block)"] = (lambda n, generator: _surrogate(A, L, lambda: average_of_draws(
        dtrpo_log_likelihood, n, model, x, y, commit, block_len=block_len, generator=generator)),
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
            holds_more = row["naive_act_mb"] > 1.01 * row["act_mb"]
            line += f" {row['naive_act_mb']:>9.1f}" + (" <- naive holds more" if holds_more else "")
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
        # about the same cost for every n_t
        pairs = max(2, N_T[-1] // n)
        same = [_cos(grad(batch1, n, 10 * r), grad(batch1, n, 10 * r + 1)) for r in range(pairs)]
        other = [_cos(grad(batch1, n, 10 * r + 2), grad(batch2, n, 10 * r + 3)) for r in range(pairs)]
        rows.append({"n_t": n, "pairs": pairs, "cos_mc": float(np.mean(same)),
                     "cos_rollouts": float(np.mean(other))})
    x, y, _, A, _ = batch2
    exact2 = _gradient(model, _exact_elbo_run(model, x, y, A))[0]
    rows.append({"n_t": "inf", "cos_mc": 1.0, "cos_rollouts": _cos(exact1, exact2)})
    print("\n3. Signal to noise of the RL gradient (BGPO; mean cosine over pairs of gradients)")
    print(f"  {'n_t':>4} {'pairs':>5} {'two MC draws, same rollouts':>28}"
          f" {'two rollout batches, same prompts':>34}")
    for row in rows:
        print(f"  {row['n_t']:>4} {row.get('pairs', ''):>5} {row['cos_mc']:>28.3f}"
              f" {row['cos_rollouts']:>34.3f}")
    return rows

def policy_gradient_check(model, task, prompts, args):
    """Is the ELBO the right thing to push? With random remasking and one token per step, the sampler
    IS the random-order model, so its exact log-likelihood log pi(y) = log E_sigma p_sigma(y) is
    known (random_order_from_table) and sum_b A_b grad log pi(y_b) is the exact policy gradient on a
    batch of its rollouts. Compared with the exact ELBO gradient and the trajectory-sum gradient
    (REINFORCE on the sampled order: unbiased for the same expected-reward gradient, but noisier).
    On the first two prompts of the lab's batch: two backward passes through 2^L rows per sequence."""
    x, y, commit, A, rewards = _rollouts(model, task, prompts[:2], args, seed=args.seed + 11,
                                         remasking="random")
    B, L = y.shape
    scale = -A.to(torch.get_default_dtype()) / (B * L)

    params = list(model.parameters())
    g_pi, g_elbo = (torch.zeros(sum(p.numel() for p in params), dtype=torch.float64) for _ in range(2))
    for b in (A != 0).nonzero()[:, 0].tolist():                                     # one table, two gradients
        table = log_probs_under_every_mask(model, x[b], y[b])
        for g, value in ((g_pi, random_order_from_table(*table)[1]), (g_elbo, elbo_from_table(*table))):
            grads = torch.autograd.grad(scale[b] * value, params, retain_graph=True, allow_unused=True)
            g += flat_grad(model, grads).double().cpu()
    g_traj = _gradient(model, _surrogate(A, L, lambda: trajectory_log_likelihood(model, x, y, commit)))[0]
    bgpo = [_gradient(model, _bgpo_run(model, x, y, A, 16, torch.Generator().manual_seed(r)))[0]
            for r in range(4)]
    rows = {"exact ELBO gradient": g_elbo, "BGPO, n_t = 16 (one draw, mean of 4)": None,
            "trajectory sum (REINFORCE on the order)": g_traj}
    print(f"\n4. The ELBO as a policy gradient: random-remasking rollouts (mean reward {rewards.mean():.3f}),"
          " whose exact log-likelihood is the random-order one")
    print(f"  {'gradient':<42} {'cosine with the exact policy gradient':>38} {'norm ratio':>11}")
    result = {}
    for name, g in rows.items():
        cos = np.mean([_cos(d, g_pi) for d in bgpo]) if g is None else _cos(g, g_pi)
        ratio = (np.mean([float(d.norm() / g_pi.norm()) for d in bgpo]) if g is None
                 else float(g.norm() / g_pi.norm()))
        result[name] = {"cos": float(cos), "norm_ratio": ratio}
        print(f"  {name:<42} {cos:>38.3f} {ratio:>11.3f}")
    return result

def estimators_figure(results):
    """The paper's Fig. 3 in small: the gradient's std and the distance of the 8-draw mean from the
    exact ELBO gradient (its "bias"), against n_t, one line per objective; data for lab.figures.draw."""
    panels = [{"title": "gradient std (mean over parameters)", "key": "std"},
              {"title": "distance of the 8-draw mean from the\nexact ELBO gradient (relative L2)",
               "key": "rel_mean_elbo"}]
    for panel in panels:
        key = panel.pop("key")
        panel.update(xlabel="n_t", xscale="log", yscale="log", lines=[
            {"label": name, "x": [row["n_t"] for row in r["rows"]], "y": [row[key] for row in r["rows"]],
             "style": "o-"}
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
    anchors = (sudoku_anchors([p for p in prompts for _ in range(G)]).to(x.device) if task.name == "sudoku"
               else None)
    if not (A != 0).any():
        raise RunError(f"every group's rollouts got equal rewards (mean {rewards.mean():.3f}): "
                       "no gradient to measure; try another --seed")
    print(f"{n_prompts} prompts x G = {G} rollouts of the SFT model on {task.name} (L = {task.gen_len}, "
          f"temperature {args.temperature}): mean reward {rewards.mean():.3f}, "
          f"{int((A != 0).sum())} sequences with A != 0")
    elbo, ro, rows, between = likelihood_table(model, x, y, commit, block_len, G, anchors)
    print_likelihood_table(elbo, ro, rows, between)
    print(f"({time.time() - t0:.0f} s)")
    if anchors is not None:
        stp = np.array(rows["STP, anchors never masked"]["var"])[:, 0]
        plain = np.array(rows["count form, no anchors"]["var"])[:, 0]
        print(f"STP's variance claim: Var(anchored) < Var(no anchors) for {int((stp < plain).sum())} "
              f"of {len(stp)} sequences; mean ratio {np.mean(stp / plain):.3f}")
    print(f"\n2. Gradient of the RL objective, on-policy, fixed advantages ({REPEATS} recomputations per row;"
          " relative distances are L2 norms divided by the golden gradient's)")
    results, g_elbo = gradient_table(model, x, y, commit, A, block_len, G, anchors)
    print(f"({time.time() - t0:.0f} s)")
    snr = signal_to_noise(model, task, prompts, args, batch, g_elbo) if anchors is None else None
    policy = policy_gradient_check(model, task, prompts, args) if anchors is None else None
    path = os.path.join(args.out_dir, f"estimators_{task.name}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"task": task.name, "elbo": elbo, "random_order": ro, "likelihood": rows,
                   "between_mask_counts": between, "gradient": results, "signal_to_noise": snr,
                   "policy_gradient": policy}, f, indent=1)
    print(f"\nwrote {path} ({time.time() - t0:.0f} s, SFT excluded)")
    if args.plot:
        draw(estimators_figure(results), os.path.join(args.out_dir, f"estimators_{task.name}.png"))

def main(argv=None):
    p = cli.make_parser("python -m lab.bench_estimators",
                        "Every likelihood estimator against exact enumeration, on the SFT model's rollouts "
                        "(the SFT model is trained first if --out-dir has none).")
    p.add_argument("--plot", action="store_true",
                   help="draw the Fig. 3 PNG, if matplotlib is installed")
    args = cli.check_args(p, p.parse_args(argv))
    task = get_task(args.task)
    return bench_estimators(args, task, bgpo.sft_model(args, task))

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.bench_estimators")
