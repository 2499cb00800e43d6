"""
Tests that double as demonstrations: each one states a claim in its name and checks it by
computing one quantity two independent ways (or against a value worked out by hand).
Everything runs in float64 on CPU, on tiny models, in seconds.

    python -m pytest -q                 # all of them
    python -m pytest -q -k equivalence  # one claim
"""
import itertools
import json
import math
import os
import time

import numpy as np

import pytest
import torch

import bgpo
import estimators
from bgpo import (ActivationMemory, bgpo_backward, bgpo_bound, draw_mc_samples, elbo_terms, exact_elbo,
                  group_advantages, log_probs_under_every_mask, naive_loss, naive_objective,
                  random_order_log_likelihood)
from tasks import TOKENIZER, get_task
from tiny_dllm import ModelConfig, TinyDLLM, generate, generate_radd, masked_log_likelihood, sft_loss, forward_process

TASK_NAMES = ["arithmetic", "countdown", "sudoku"]


@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def tiny_model(seed=0, vocab_size=10, max_len=12, scale=0.5):
    """A random model whose conditionals differ clearly from position to position."""
    torch.manual_seed(seed)
    model = TinyDLLM(ModelConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=16, max_len=max_len, mask_id=1))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=scale)
    return model


def random_batch(B=6, P=3, L=5, vocab_size=10, seed=0):
    """Prompts and completions of ordinary tokens (ids 2.., never MASK=1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (B, P), generator=g), torch.randint(2, vocab_size, (B, L), generator=g)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def report(a, b):
    diff = (a - b).abs()
    return f"max |diff| {diff.max().item():.3g}, mean |diff| {diff.mean().item():.3g}"


# -----------------------------------------------------------------------------
# The model and the sampler


def test_mask_is_never_predicted():
    model = tiny_model()
    x, y = random_batch()
    logits = model(torch.cat([x, y], 1))
    assert torch.isneginf(logits[..., 1]).all() and torch.isfinite(logits[..., 2:]).all()
    assert (logits.softmax(-1)[..., 1] == 0).all()
    for temperature in (0.0, 1.0, 5.0):
        out = generate(model, x, 5, temperature=temperature, generator=torch.Generator().manual_seed(0))
        assert not (out == 1).any(), f"MASK left at temperature {temperature}"


def test_prompt_is_never_masked():
    model = tiny_model()
    x, y = random_batch()
    seen = []
    model.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0].clone()))
    sft_loss(model, x, y, generator=torch.Generator().manual_seed(0))
    elbo_terms(model, x, y, draw_mc_samples(6, 5, 4, torch.Generator().manual_seed(0)))
    for tokens in seen:
        assert (tokens[:, :3] == x.repeat_interleave(tokens.shape[0] // 6, 0)).all()
        assert (tokens[:, 3:] == 1).any(), "some completion token should be masked"


def test_sft_loss_equals_hand_computation_for_a_fixed_mask():
    model = tiny_model()
    x, y = random_batch(B=3)
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    by_hand = []  # one row at a time, one position at a time
    for b in range(3):
        tokens = torch.cat([x[b], torch.where(mask[b], 1, y[b])])
        logp = model(tokens[None])[0].log_softmax(-1)
        by_hand.append(sum(logp[3 + i, y[b, i]] for i in range(5) if mask[b, i]))
    got = masked_log_likelihood(model, x, y, mask)
    assert torch.allclose(got, torch.stack(by_hand), atol=1e-12), report(got, torch.stack(by_hand))
    # sft_loss = -(1/L) mean_b (L/k_b) * that sum, for the mask its generator draws
    mask, weight = forward_process(3, 5, torch.Generator().manual_seed(7))
    assert torch.equal(weight, 5.0 / mask.sum(1))
    expected = -(weight * masked_log_likelihood(model, x, y, mask)).mean() / 5
    got = sft_loss(model, x, y, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(got, expected, atol=1e-12), report(got, expected)


def test_generate_leaves_no_mask_fills_blocks_in_order_and_is_deterministic_when_greedy():
    model = tiny_model(max_len=3 + 8)
    x, _ = random_batch()
    out, step_of = generate(model, x, 8, steps=4, block_len=4, return_steps=True)
    assert not (out == 1).any()
    assert (step_of[:, :4] < 2).all() and (step_of[:, 4:] >= 2).all(), "block 2 started before block 1 ended"
    counts = torch.stack([(step_of == s).sum(1) for s in range(4)], 1)
    assert (counts == 2).all(), f"8 tokens in 4 steps should be 2 per step, got {counts[0].tolist()}"
    assert torch.equal(out, generate(model, x, 8, steps=4, block_len=4))
    assert torch.equal(generate(model, x, 8, steps=3), generate(model, x, 8, steps=3))
    with pytest.raises(ValueError, match="steps"):
        generate(model, x, 8, steps=9)


# -----------------------------------------------------------------------------
# Tasks: tokenizer, splits and rewards


def test_random_remasking_samples_from_the_random_order_likelihood():
    """With remasking="random" and one token per step, generate draws y with probability
    E_sigma p_sigma(y), which random_order_log_likelihood computes (its second output): the 81
    probabilities over two positions sum to 1 and match the frequencies of 20,000 samples."""
    model, N = tiny_model(), 20000
    x, _ = random_batch(B=1, L=2)
    y = generate(model, x.expand(N, -1), 2, temperature=1.0, generator=torch.Generator().manual_seed(0), remasking="random")
    tokens = [t for t in range(10) if t != 1]                                      # every id but MASK
    with torch.no_grad():
        exact = {(a, b): random_order_log_likelihood(model, x[0], torch.tensor([a, b]))[1].exp().item()
                 for a in tokens for b in tokens}
    assert abs(sum(exact.values()) - 1) < 1e-12, sum(exact.values())
    counts = {}
    for a, b in y.tolist():
        counts[a, b] = counts.get((a, b), 0) + 1
    for pair, p in exact.items():
        empirical = counts.get(pair, 0) / N
        assert abs(empirical - p) < 4.5 * math.sqrt(p * (1 - p) / N) + 1e-4, (pair, empirical, p)


def test_radd_cached_sampler_gives_the_same_samples_as_uncached():
    model = tiny_model()
    x, _ = random_batch(B=64, L=5)
    for temperature in (0.0, 1.0):
        (y1, calls1), (y2, calls2) = (generate_radd(model, x, 5, 20, temperature, torch.Generator().manual_seed(3), cache)
                                      for cache in (True, False))
        assert torch.equal(y1, y2) and (y1 != 1).all(), "same draws, same samples, no MASK left"
        assert (calls1 <= calls2).all() and calls1.sum() < calls2.sum()


@pytest.mark.parametrize("n_steps", [5, 10, 40])
def test_radd_cached_calls_per_sequence_match_the_expected_count(n_steps):
    """Reveal steps are uniform over the N steps and independent, so the number of distinct steps
    with a reveal, which is the number of calls, has mean N (1 - (1 - 1/N)^L)."""
    model, L = tiny_model(), 5
    x, _ = random_batch(B=4000, L=L)
    calls = generate_radd(model, x, L, n_steps, 1.0, torch.Generator().manual_seed(n_steps))[1].double()
    expected = n_steps * (1 - (1 - 1 / n_steps) ** L)
    se = calls.std() / math.sqrt(len(calls))
    assert abs(calls.mean() - expected) < 4 * se, f"mean calls {calls.mean():.4f}, expected {expected:.4f}, SE {se:.4f}"


def test_tokenizer_round_trip():
    for name in TASK_NAMES:
        task = get_task(name)
        prompts, answers = task.sample(50, "train", 0)
        for text in prompts + answers:
            assert task.decode(task.encode(text)) == text
        y = TOKENIZER.encode_batch(answers, task.gen_len, "right")
        assert [task.decode(row) for row in y] == answers  # EOS padding ends the answer
    assert len({TOKENIZER.pad_id, TOKENIZER.mask_id, TOKENIZER.eos_id}) == 3
    with pytest.raises(ValueError, match="text"):
        TOKENIZER.encode("1+a")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_train_and_test_splits_are_disjoint(name):
    task = get_task(name)
    train_p, train_a = task.sample(3000, "train", 0)
    test_p, test_a = task.sample(300, "test", 1)
    if name == "sudoku":  # split by solution grid
        assert not set(train_a) & set(test_a)
    elif name == "countdown":  # the same numbers in another order are the same problem
        key = lambda p: (tuple(sorted(p.split(":")[0].split(","))), p.split(":")[1])
        assert not {key(p) for p in train_p} & {key(p) for p in test_p}
    else:
        assert not set(train_p) & set(test_p)
    assert all(task.reward(p, a) == 1.0 for p, a in zip(test_p, test_a)), "reference answers must score 1"


REWARDS = [  # task, prompt, completion, reward worked out by hand
    ("arithmetic", "482+517=", "999", 1.0),
    ("arithmetic", "482+517=", "999$$", 1.0),
    ("arithmetic", "482+517=", "998", 0.0),
    ("arithmetic", "482+517=", "0999", 0.0),
    ("countdown", "7,3,12:33", "(7+3)*3", 0.1),        # well formed, but 3 is not 12
    ("countdown", "7,3,12:33", "3*7+12", 1.0),
    ("countdown", "7,3,12:33", "12+7*3$", 1.0),        # another correct solution
    ("countdown", "7,3,12:33", "12+7+3", 0.1),         # right numbers, wrong value
    ("countdown", "7,3,12:33", "33", 0.1),             # does not use the numbers
    ("countdown", "8,4,2:1", "8/4/2", 1.0),
    ("countdown", "8,4,2:4", "8/(4-2)*1", 0.1),
    ("countdown", "5,5,2:2", "5/(5-5)+2", 0.1),        # division by zero: wrong, not a crash
    ("countdown", "5,5,2:2", "5-(5-2", 0.0),           # unbalanced
    ("countdown", "5,5,2:2", "5--5+2", 0.0),
    ("sudoku", "1.3.|..1.|.1..|3.2.", "1234431221433421", 1.0),
    ("sudoku", "1.3.|..1.|.1..|3.2.", "1134331221433421", 0.8),   # 2 of 10 blanks wrong
    ("sudoku", "1.3.|..1.|.1..|3.2.", "4234431221433421", 1.0),   # a given cell is not graded
    ("sudoku", "1.3.|..1.|.1..|3.2.", "1234", 0.2),               # 2 of 10 blanks present and right
]


@pytest.mark.parametrize("name, prompt, completion, expected", REWARDS)
def test_reward_table(name, prompt, completion, expected):
    assert get_task(name).reward(prompt, completion) == pytest.approx(expected)


HOSTILE = ["", " ", "x" * 1_000_000, "__import__('os').system('ls')", "9**9**9**9", "((((((((", "))))",
           "9999999999*9999999999", "1/0", "é中🙂", "\x00\n$", "(" * 500 + "1" + ")" * 500, "1" * 100_000]


@pytest.mark.parametrize("name", TASK_NAMES)
def test_rewards_survive_hostile_output(name):
    task = get_task(name)
    prompt = task.sample(1, "test", 0)[0][0]
    for text in HOSTILE:
        t0 = time.perf_counter()
        r = task.reward(prompt, text)
        assert isinstance(r, float) and 0.0 <= r <= 1.0 and time.perf_counter() - t0 < 0.1, text[:20]
        assert 0.0 <= task.reward(text, "1+2") <= 1.0  # even a garbage prompt does not raise


# -----------------------------------------------------------------------------
# The ELBO: exact value by enumeration, and its Monte Carlo estimates


def test_exact_elbo_equals_random_order_log_likelihood_and_bounds_it():
    model = tiny_model()
    x, y = random_batch(B=3)
    for b in range(3):
        elbo = exact_elbo(model, x[b], y[b])                               # sum over the 31 mask sets
        expected_log_lik, log_expected_lik = random_order_log_likelihood(model, x[b], y[b])  # DP over the 32 sets
        assert abs(elbo - expected_log_lik) < 1e-9, f"ELBO {elbo:.12f} vs E_sigma log p {expected_log_lik:.12f}"
        assert elbo <= log_expected_lik + 1e-12
        assert log_expected_lik - elbo > 1e-3, "the Jensen gap should be visible for a random model"


@pytest.mark.parametrize("scheme", ["stratified", "iid"])
def test_mc_elbo_is_unbiased(scheme):
    model = tiny_model()
    x, y = random_batch(B=1)
    exact = exact_elbo(model, x[0], y[0])
    n = 20000
    with torch.no_grad():
        l = elbo_terms(model, x, y, draw_mc_samples(1, 5, n, torch.Generator().manual_seed(1), scheme))[0]
    se = l.std() / math.sqrt(n)
    assert abs(l.mean() - exact) < 4 * se, f"{scheme}: MC {l.mean():.4f} vs exact {exact:.4f}, SE {se:.4f}"


def test_stratified_has_lower_variance_than_iid():
    model = tiny_model()
    x, y = random_batch(B=1)
    with torch.no_grad():
        # variance of the n_t = 4 estimate B_hat = mean_j l_j, over 2000 independent batches of draws
        est = {s: elbo_terms(model, x.expand(2000, -1), y.expand(2000, -1),
                             draw_mc_samples(2000, 5, 4, torch.Generator().manual_seed(2), s)).mean(1)
               for s in ("stratified", "iid")}
    assert est["stratified"].var() < 0.5 * est["iid"].var(), {s: e.var().item() for s, e in est.items()}


def test_stratified_draw_masks_at_least_one_token_and_spreads_counts():
    mc = draw_mc_samples(50, 8, 8, torch.Generator().manual_seed(0))
    k = mc.mask.sum(-1)                                                    # (B, M)
    assert (k >= 1).all()
    assert all(sorted(row) == list(range(1, 9)) for row in k.tolist()), "8 samples over L=8: each count once"
    assert torch.equal(mc.weight, 8.0 / k)
    k = draw_mc_samples(50, 8, 4, torch.Generator().manual_seed(0)).mask.sum(-1)
    assert ((k.roll(-1, 1) - k) % 8 == 2).all(), "4 samples over L=8: counts 2 apart, cyclically"


# -----------------------------------------------------------------------------
# The estimator lab (estimators.py): exact enumeration against the estimators' own samplers


def test_random_order_dynamic_programming_equals_enumerating_all_orders():
    model = tiny_model()
    for L in (4, 6):
        x, y = random_batch(B=1, L=L, seed=L)
        with torch.no_grad():
            masks, logp = log_probs_under_every_mask(model, x[0], y[0])
            row = lambda S: sum(1 << i for i in S) - 1                             # a set's row in the table
            per_order = torch.stack([sum(logp[row(sigma[n:]), sigma[n]] for n in range(L))   # L! orders
                                     for sigma in itertools.permutations(range(L))])
            mean, log_mean_exp = random_order_log_likelihood(model, x[0], y[0])   # 2^L sets
        assert abs(mean - per_order.mean()) < 1e-10, (L, mean.item(), per_order.mean().item())
        assert abs(log_mean_exp - (per_order.logsumexp(0) - math.log(len(per_order)))) < 1e-10


def test_exact_elbo_gradient_is_the_probability_weighted_sum_of_per_mask_gradients():
    model = tiny_model()
    x, y = random_batch(B=1, L=4)
    model.zero_grad()
    exact_elbo(model, x[0], y[0]).backward()
    autograd = grads(model)
    model.zero_grad()
    for k in range(1, 5):                                                          # k ~ U{1..4}, then a uniform k-set
        for S in itertools.combinations(range(4), k):
            mask = torch.zeros(1, 4, dtype=torch.bool)
            mask[0, list(S)] = True
            p = 1 / (4 * math.comb(4, k))
            (p * (4 / k) * masked_log_likelihood(model, x, y, mask)).sum().backward()
    assert torch.allclose(autograd, grads(model), atol=1e-10, rtol=0), report(autograd, grads(model))


def assert_moments(draws, mean, var, what):
    """Sample mean and variance of many draws against exact values, within 4.5 standard errors."""
    n, m, v = len(draws), draws.mean(), draws.var()
    se_mean, se_var = (v / n).sqrt(), (((draws - m) ** 4).mean() - v**2).clamp(min=0).div(n).sqrt()
    assert abs(m - mean) < 4.5 * se_mean + 1e-12, f"{what}: mean {m:.5f} vs exact {float(mean):.5f} (SE {se_mean:.5f})"
    assert abs(v - var) < 4.5 * se_var + 1e-12, f"{what}: variance {v:.5f} vs exact {float(var):.5f} (SE {se_var:.5f})"


@pytest.mark.parametrize("n_t", [1, 3, 5])
def test_elbo_estimators_exact_means_equal_the_exact_elbo_and_exact_variances_match_their_samplers(n_t):
    model, L = tiny_model(), 5
    x, y = random_batch(B=1, L=L)
    elbo = exact_elbo(model, x[0], y[0]).item()
    masks, logp, a, full = estimators.exact_table(model, x[0], y[0])
    stats = estimators._size_stats(a, L)
    # iid: E[a(S)/t] = int_0^1 sum_S t^(k-1) (1-t)^(L-k) a(S) dt, a polynomial in t: 8 Gauss-Legendre nodes are exact
    k = masks.sum(1).double()
    nodes, weights = np.polynomial.legendre.leggauss(8)
    iid_mean = sum(w / 2 * (t ** (k - 1) * (1 - t) ** (L - k) * a[1:]).sum() for t, w in zip((nodes + 1) / 2, weights))
    strat_mean, strat_var = estimators.stratified_moments(stats, n_t)
    anti_mean, anti_var = estimators.antithetic_moments(a, L)
    for name, mean in (("iid", iid_mean), ("stratified", strat_mean), ("antithetic", anti_mean)):
        assert abs(mean - elbo) < 1e-10, f"{name}: exact mean {mean:.12f} vs ELBO {elbo:.12f}"
    N, g = 5000, torch.Generator().manual_seed(n_t)
    with torch.no_grad():
        strat = elbo_terms(model, x.expand(N, -1), y.expand(N, -1), draw_mc_samples(N, L, n_t, g)).mean(1)
        anti = estimators.average_of_draws(estimators.antithetic_elbo, n_t, model, x.expand(N, -1), y.expand(N, -1), generator=g)
    assert_moments(strat, strat_mean, strat_var, f"stratified, n_t={n_t}")
    assert_moments(anti, anti_mean, anti_var / n_t, f"antithetic, {n_t} pairs")


def test_antithetic_pair_variance_against_two_independent_draws_and_stratified_two():
    """Measured, not assumed: on a random model, over 8 sequences, the pair (2 forward passes) has less
    than half the variance of two independent count-form draws and of the stratified n_t = 2 (also 2
    passes). On the trained Countdown model it is the other way round against the stratified pair
    (README, --bench-estimators): there the mask count matters more than which positions are masked."""
    model, ratios = tiny_model(), []
    for seed in range(8):
        x, y = random_batch(B=1, L=6, seed=seed)
        a = estimators.exact_table(model, x[0], y[0])[2]
        stats = estimators._size_stats(a, 6)
        pair, single, strat = estimators.antithetic_moments(a, 6)[1], estimators.count_form_moments(stats)[1], \
            estimators.stratified_moments(stats, 2)[1]
        ratios.append((float(pair / (single / 2)), float(pair / strat)))
    ratios = np.array(ratios)
    print("Var(pair) / Var(2 independent):", ratios[:, 0].round(3), "Var(pair) / Var(stratified 2):", ratios[:, 1].round(3))
    assert (ratios < 0.5).all()


def test_coupled_one_step_trajectory_and_stp_estimators_have_the_exact_moments_enumeration_gives():
    model, L, N = tiny_model(max_len=14), 6, 8000
    x, y = random_batch(B=2, P=4, L=L)
    commit = generate(model, x, L, steps=4, block_len=3, temperature=1.0, generator=torch.Generator().manual_seed(0),
                      return_steps=True)[1]
    y = generate(model, x, L, steps=4, block_len=3, temperature=1.0, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([True, False, False, True, False, False])
    masks, logp, a, full = estimators.exact_table(model, x[0], y[0])
    many = lambda t: t[:1].expand(N, -1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        traj = estimators.trajectory_log_likelihood(model, x[:1], y[:1], commit[:1]).item()    # one forward per step
        cases = {
            "DiffuCoder": (estimators.diffucoder_moments(a, full[-1].sum(), L),
                           estimators.diffucoder_coupled(model, many(x), many(y), g)),
            "one-step, p=0.15": ([m[0] for m in estimators.one_step_prompt_mask_moments(model, x[0], y[:1], 0.15)],
                                 estimators.one_step_log_likelihood(model, many(x), many(y), 0.15, g)),
            "STP": (estimators.count_form_moments(estimators._size_stats(a, L, ~anchors)),
                    estimators.stp_log_likelihood(model, many(x), many(y), anchors.expand(N, -1), g))}
        for block_len in (3, 6):
            cases[f"dTRPO, blocks of {block_len}"] = (estimators.trajectory_moments(full, commit[0], block_len),
                estimators.dtrpo_log_likelihood(model, many(x), many(y), many(commit), block_len, g))
    for name, ((mean, var), draws) in cases.items():
        assert_moments(draws, mean, var, name)
    for block_len in (3, 6):
        table_sum = estimators.trajectory_moments(full, commit[0], block_len)[0]
        assert abs(table_sum - traj) < 1e-10, f"trajectory sum: table {table_sum:.12f} vs K forwards {traj:.12f}"
    stp_mean = estimators.anchored_elbo(model, x[0], y[0], ~anchors).item()
    assert abs(cases["STP"][0][0] - stp_mean) < 1e-10


def test_estimators_reject_bad_shapes_with_a_value_error_naming_the_argument():
    model = tiny_model()
    x, y = random_batch(B=3)
    commit = torch.arange(5).expand(3, 5)
    for call, name in ((lambda: estimators.one_step_log_likelihood(model, x[:2], y), "prompts, completions"),
                       (lambda: estimators.antithetic_elbo(model, x, y[:, None]), "prompts, completions"),
                       (lambda: estimators.one_step_log_likelihood(model, x, y, prompt_mask_prob=1.5), "prompt_mask_prob"),
                       (lambda: estimators.trajectory_log_likelihood(model, x, y, commit[:, :4]), "commit_steps"),
                       (lambda: estimators.dtrpo_log_likelihood(model, x, y, commit - 1), "commit_steps"),
                       (lambda: estimators.stp_log_likelihood(model, x, y, torch.ones(3, 5, dtype=torch.bool)), "anchors")):
        with pytest.raises(ValueError, match=name):
            call()


def test_one_step_estimate_is_its_closed_form_and_is_not_the_elbo():
    model = tiny_model()
    x, y = random_batch(B=3)
    with torch.no_grad():
        one_step = estimators.one_step_log_likelihood(model, x, y)
        for b in range(3):
            masks, logp = log_probs_under_every_mask(model, x[b], y[b])
            closed_form = logp[-1].sum()                                           # the all-masked row, summed
            gap = one_step[b] - exact_elbo(model, x[b], y[b])
            print(f"sequence {b}: one-step {one_step[b]:.4f}, ELBO minus it {-gap:.4f} nats")
            assert abs(one_step[b] - closed_form) < 1e-12
            assert abs(gap) > 0.05, "the mean field is a different quantity from the ELBO"


@pytest.fixture(scope="module")
def sudoku_toy():
    """A 1-layer, n_embd 16 model after 150 SFT steps on 4x4 Sudoku (float32: the 2^16 mask sets per
    sequence are the cost), and four held-out puzzles."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    task, g = get_task("sudoku"), torch.Generator().manual_seed(0)
    x, y = bgpo.encode(task, *task.sample(256, "train", 0))
    torch.manual_seed(0)
    model = TinyDLLM(ModelConfig(vocab_size=task.tokenizer.vocab_size, n_layer=1, n_head=1, n_embd=16, max_len=35))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        rows = torch.randint(0, 256, (64,), generator=g)
        loss = sft_loss(model, x[rows], y[rows], generator=g)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    prompts, answers = task.sample(4, "test", 5)
    torch.set_default_dtype(old)
    return model, prompts, *bgpo.encode(task, prompts, answers)


# measured: anchoring lowers the variance for all four puzzles, by 14-66% (the README has the 0.6M model's)
@pytest.mark.parametrize("b, lower", [(0, True), (1, True), (2, True), (3, True)])
def test_stp_anchors_variance_against_no_anchors_exactly_on_a_trained_sudoku_model(sudoku_toy, b, lower):
    """STP's claim, "strictly reduces the variance of the log-likelihood estimation", checked exactly
    (all 2^16 mask sets) for the count-form ELBO with and without anchors (Sudoku's given cells)."""
    model, prompts, x, y = sudoku_toy
    torch.set_default_dtype(torch.float32)
    anchors = estimators.sudoku_anchors(prompts)[b]
    a = estimators.exact_table(model, x[b], y[b])[2]
    var = lambda free: estimators.count_form_moments(estimators._size_stats(a, 16, free))[1].item()
    print(f"puzzle {prompts[b]}: Var(anchored) {var(~anchors):.3f}, Var(no anchors) {var(None):.3f}")
    assert (var(~anchors) < var(None)) == lower


# -----------------------------------------------------------------------------
# The objectives: equivalence on-policy, the bound off-policy, memory


def on_policy_setup(M=6, seed=0):
    model = tiny_model(seed)
    x, y = random_batch(B=6)
    mc = draw_mc_samples(6, 5, M, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        old_terms = elbo_terms(model, x, y, mc)
    A = torch.tensor([1.5, -0.5, 0.0, -1.2, 0.7, 0.0])                   # positive, negative and zero
    return model, x, y, mc, old_terms, A


def test_bgpo_value_equals_naive_on_policy():
    model, x, y, mc, old_terms, A = on_policy_setup()
    naive = naive_loss(model, x, y, mc, old_terms, A)
    bound = bgpo_backward(model, x, y, mc, old_terms, A)
    assert abs(naive.item() - bound) < 1e-12 and abs(bound + A.mean().item()) < 1e-12, (naive.item(), bound)


@pytest.mark.parametrize("mc_chunk", [1, 3, 6])
def test_bgpo_gradient_equals_naive_on_policy(mc_chunk):
    model, x, y, mc, old_terms, A = on_policy_setup()
    naive_loss(model, x, y, mc, old_terms, A).backward()
    g_naive = grads(model)
    model.zero_grad()
    bgpo_backward(model, x, y, mc, old_terms, A, mc_chunk=mc_chunk)
    g_bgpo = grads(model)
    rel = (g_naive - g_bgpo).norm() / g_naive.norm()
    assert rel < 1e-8, f"relative difference {rel:.3g}; {report(g_naive, g_bgpo)}"


def test_clipping_is_inactive_on_policy():
    model, x, y, mc, old_terms, A = on_policy_setup()
    bgpo_backward(model, x, y, mc, old_terms, A)
    g = grads(model)
    model.zero_grad()
    bgpo_backward(model, x, y, mc, old_terms, A, clip_eps=0.2, mc_chunk=2)
    assert torch.allclose(g, grads(model), rtol=1e-10, atol=1e-14), report(g, grads(model))


def test_bgpo_is_a_lower_bound_off_policy_and_gradients_differ():
    model, x, y, mc, old_terms, A = on_policy_setup()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    naive_loss(model, x, y, mc, old_terms, A).backward()
    optimizer.step()                                                      # now theta != theta_old
    model.zero_grad()
    d = (elbo_terms(model, x, y, mc) - old_terms) / 5
    naive, bound = naive_objective(d, A), bgpo_bound(d, A, 6).sum(1)      # (B,) each
    assert (bound <= naive + 1e-12).all(), f"bound above R_hat by {(bound - naive).max():.3g}"
    assert (naive - bound)[A != 0].min() > 0, "off-policy the bound should be strictly below where A != 0"
    naive_loss(model, x, y, mc, old_terms, A).backward()
    g_naive = grads(model)
    model.zero_grad()
    bgpo_backward(model, x, y, mc, old_terms, A)
    rel = (g_naive - grads(model)).norm() / g_naive.norm()
    print(f"off-policy: mean |d_j| {d.abs().mean():.3f}, R_hat - R_lb up to {(naive - bound).max():.4f}, "
          f"relative gradient difference {rel:.3f}")
    assert rel > 1e-4


def test_bgpo_activation_memory_is_flat_and_naive_grows_with_n_t():
    peak = {}
    for M in (1, 32):
        model, x, y, mc, old_terms, A = on_policy_setup(M)
        with ActivationMemory(model) as naive:
            naive_loss(model, x, y, mc, old_terms, A).backward()
        assert naive.current == 0, "everything saved for backward is freed after it"
        with ActivationMemory(model) as bound:
            bgpo_backward(model, x, y, mc, old_terms, A)
        peak[M] = naive.peak, bound.peak
    print(f"peak activation bytes (naive, BGPO): n_t=1 {peak[1]}, n_t=32 {peak[32]}")
    assert peak[32][1] <= 1.1 * peak[1][1], "BGPO's memory should not grow with n_t"
    assert peak[32][0] >= 16 * peak[1][0], "the naive objective keeps all n_t graphs alive"


def test_no_nan_or_inf_for_extreme_log_ratios():
    d = torch.tensor([[-1.0, -3.0, 30.0, 0.0], [-50.0, 2.0, 25.0, -1.0], [700.0, 1.0, -1.5, 0.0]], requires_grad=True)
    A = torch.tensor([1.0, -1.0, 0.5])
    for clip_eps in (None, 0.2):
        value = bgpo_bound(d, A, 4, clip_eps).sum()   # 1 + d for A >= 0: never log(1 + d), never exp(700)
        (g,) = torch.autograd.grad(value, d)
        assert torch.isfinite(value) and torch.isfinite(g).all(), (value, g)
        value = naive_objective(d[:2], A[:2], clip_eps).sum()
        (g,) = torch.autograd.grad(value, d)
        assert torch.isfinite(value) and torch.isfinite(g).all(), (value, g)
    # hand values: A=1 row: (1 + d_j) / 4; A=-1 row: -e^{d_j} / 4
    expected = torch.stack([(1 + d[0]) / 4, -d[1].exp() / 4])
    assert torch.allclose(bgpo_bound(d[:2], A[:2], 4), expected)


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1])
    A = group_advantages(r, 4)
    std = math.sqrt(((0.75 ** 2) + 3 * 0.25 ** 2) / 3)                    # unbiased std of (1, 0, 0, 0)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6)
    assert torch.allclose(A[:4], expected) and (A[4:] == 0).all(), A


def test_bad_shapes_raise_value_errors_naming_the_argument():
    model, x, y, mc, old_terms, A = on_policy_setup()
    cases = {"completions": dict(completions=y[:5]), "old_terms": dict(old_terms=old_terms[:, :5]),
             "advantages": dict(advantages=A[:, None]), "mc.mask": dict(mc=bgpo.MCSamples(mc.mask[:, :, :4], mc.weight)),
             "prompts": dict(prompts=x[0])}
    for name, override in cases.items():
        kwargs = {**dict(model=model, prompts=x, completions=y, mc=mc, old_terms=old_terms, advantages=A), **override}
        for fn in (naive_loss, bgpo_backward):
            with pytest.raises(ValueError, match=name.replace(".", r"\.")):
                fn(**kwargs)
    with pytest.raises(ValueError, match="advantages"):
        bgpo_backward(model, x, y, mc, old_terms, torch.full((6,), float("nan")))
    with pytest.raises(ValueError, match="mc_chunk"):
        bgpo_backward(model, x, y, mc, old_terms, A, mc_chunk=0)
    with pytest.raises(ValueError, match="n_mc"):
        draw_mc_samples(6, 5, 0)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), 4)


# -----------------------------------------------------------------------------
# The pipeline: SFT, checkpoints, the RL loop, resume, the command line


def tiny_argv(tmp_path, *extra):
    """Command-line flags for a model and run small enough to train in seconds."""
    return ["--task", "arithmetic", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
            "--sft-steps", "100", "--sft-lr", "3e-3", "--batch-size", "32", "--prompts-per-step", "2",
            "--group-size", "4", "--mc-samples", "4", "--rl-steps", "2", "--eval-size", "8",
            "--eval-every", "1", "--save-every", "1", "--out-dir", str(tmp_path), "--device", "cpu", *extra]


def tiny_args(tmp_path, *extra):
    return bgpo.parse_args(tiny_argv(tmp_path, *extra))


def test_short_sft_lowers_the_loss_and_checkpoint_round_trips(tmp_path):
    args, task = tiny_args(tmp_path), get_task("arithmetic")
    x, y = bgpo.encode(task, *task.sample(256, "test", 0))
    torch.manual_seed(args.seed)                                          # run_sft's initial weights
    before = sft_loss(bgpo.make_model(task, args), x, y, torch.Generator().manual_seed(0)).item()
    model = bgpo.run_sft(args, task)
    after = sft_loss(model, x, y, torch.Generator().manual_seed(0)).item()
    assert after < 0.8 * before, f"held-out SFT loss {before:.3f} -> {after:.3f}"

    loaded, _ = bgpo.load_model(bgpo.sft_path(args), task, args)
    tokens = torch.cat([x, y], 1)[:16]
    assert torch.equal(model(tokens), loaded(tokens))
    with pytest.raises(ValueError, match="made for task 'arithmetic', not 'countdown'"):
        bgpo.load_checkpoint(bgpo.sft_path(args), get_task("countdown"))
    with pytest.raises(ValueError, match="another model config"):
        bgpo.load_model(bgpo.sft_path(args), task, tiny_args(tmp_path, "--n-embd", "32"))
    with open(tmp_path / "broken.pt", "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        bgpo.load_checkpoint(str(tmp_path / "broken.pt"), task)


@pytest.mark.parametrize("objective", ["bgpo", "naive"])
def test_two_rl_steps_run_for_each_objective(tmp_path, objective):
    history = bgpo.main(tiny_argv(tmp_path, "--objective", objective))
    assert [h["step"] for h in history] == [0, 1, 2]
    run = tmp_path / f"arithmetic_{objective}_nt4_u1_seed0"
    records = bgpo.read_log(run / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and (run / "ckpt.pt").exists()
    assert records[0]["accuracy"] == history[0]["accuracy"], "step 0 is the SFT model's evaluation"


def test_rl_pool_practises_only_on_its_problems_and_reports_their_accuracy(tmp_path, monkeypatch):
    real, rollout_prompts = bgpo.encode, []

    def recording_encode(task, prompts, answers=None, device="cpu"):
        if len(prompts) == 2 * 4:                                        # prompts-per-step x group-size
            rollout_prompts.extend(prompts)
        return real(task, prompts, answers, device)

    monkeypatch.setattr(bgpo, "encode", recording_encode)
    history = bgpo.main(tiny_argv(tmp_path, "--rl-pool", "3", "--rl-steps", "3", "--eval-size", "5"))
    pool, _ = get_task("arithmetic").sample(3, "train", 0 + 2)           # seed + 2, as run_rl draws it
    assert len(rollout_prompts) == 3 * 8 and set(rollout_prompts) <= set(pool)
    assert all(0.0 <= h["pool_accuracy"] <= 1.0 for h in history)
    assert (tmp_path / "arithmetic_bgpo_nt4_u1_pool3_seed0" / "ckpt.pt").exists()


def test_rl_warmup_raises_the_learning_rate_linearly(tmp_path, monkeypatch):
    real, lrs = bgpo.rl_update, []

    def recording_update(model, optimizer, *args):
        lrs.append(optimizer.param_groups[0]["lr"])
        return real(model, optimizer, *args)

    monkeypatch.setattr(bgpo, "rl_update", recording_update)
    bgpo.main(tiny_argv(tmp_path, "--rl-lr", "1e-3", "--rl-warmup", "4", "--rl-steps", "6", "--eval-every", "6"))
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rel=1e-12)


def test_one_on_policy_update_gives_the_same_parameters_for_bgpo_and_naive(tmp_path):
    model, x, y, mc, old_terms, A = on_policy_setup()
    new_params = {}
    for objective in ("bgpo", "naive"):
        torch.manual_seed(0)
        m = tiny_model()
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        bgpo.rl_update(m, optimizer, tiny_args(tmp_path, "--objective", objective), x, y,
                       {"mc": mc, "old_terms": old_terms}, A)
        new_params[objective] = torch.cat([p.detach().flatten() for p in m.parameters()])
    moved = (new_params["bgpo"] - torch.cat([p.detach().flatten() for p in model.parameters()])).abs().max()
    assert moved > 1e-3, "the update should move the parameters"
    assert torch.allclose(new_params["bgpo"], new_params["naive"], rtol=0, atol=1e-9), report(*new_params.values())


def test_the_update_is_built_from_its_positive_and_negative_parts_and_adds_up_to_the_full_step(tmp_path):
    """rl_update backpropagates the rows with A > 0 and those with A < 0 separately; the parts it
    reports must be the gradients of A+ and A- on the whole batch, and its step that of the full loss."""
    model, x, y, mc, old_terms, A = on_policy_setup()
    parts = []
    for a in (A.clamp(min=0), A.clamp(max=0), A):
        model.zero_grad()
        bgpo_backward(model, x, y, mc, old_terms, a)
        parts.append(grads(model).clone())
    g_pos, g_neg, g_full = parts
    assert torch.allclose(g_pos + g_neg, g_full, atol=1e-12)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    loss, split = bgpo.rl_update(model, torch.optim.SGD(model.parameters(), lr=1.0), tiny_args(tmp_path), x, y,
                                 {"mc": mc, "old_terms": old_terms}, A)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert split["grad_pos"] == pytest.approx(g_pos.norm().item(), rel=1e-9)
    assert split["grad_neg"] == pytest.approx(g_neg.norm().item(), rel=1e-9)
    assert split["cos_pos_neg"] == pytest.approx((g_pos @ g_neg / (g_pos.norm() * g_neg.norm())).item(), rel=1e-9)
    assert loss == pytest.approx(-A.mean().item(), abs=1e-12)                # on-policy the bound's value is -mean A
    step = g_full * min(1.0, 1.0 / g_full.norm().item())                      # clip_grad_norm_(1.0), then SGD lr 1
    assert torch.allclose(before - after, step, atol=1e-9), report(before - after, step)


def test_trajectory_backward_is_the_gradient_of_the_trajectory_objective():
    """One backward per sampler step adds up to autograd through the whole trajectory sum."""
    model = tiny_model()
    x, _ = random_batch(B=4)
    y, commit = generate(model, x, 5, steps=3, temperature=1.0, generator=torch.Generator().manual_seed(0), return_steps=True)
    A = torch.tensor([1.0, -0.5, 0.0, -0.5])
    loss = -(A * estimators.trajectory_log_likelihood(model, x, y, commit)).mean() / 5
    loss.backward()
    expected = grads(model).clone()
    model.zero_grad()
    value = estimators.trajectory_backward(model, x, y, commit, A)
    assert value == pytest.approx(loss.item(), abs=1e-12)
    assert torch.allclose(grads(model), expected, atol=1e-12), report(grads(model), expected)


def test_prediction_entropy_of_a_uniform_model_is_log_of_the_tokens_it_can_write():
    model = tiny_model()
    torch.nn.init.zeros_(model.head.weight)                                   # every logit 0; MASK's is -inf
    x, _ = random_batch(B=3)
    assert bgpo.prediction_entropy(model, x, 5) == pytest.approx(math.log(model.config.vocab_size - 1), abs=1e-12)


@pytest.mark.parametrize("task_name, prompt, completion, valid", [
    ("countdown", "15,4,1:64", "15*4+1", True),             # right numbers, wrong value: still valid
    ("countdown", "15,4,1:64", "4+11+5", False),            # numbers not in the prompt: the collapse
    ("countdown", "15,4,1:64", "15*4", False),              # a number dropped
    ("countdown", "15,4,1:64", "((((", False),
    ("arithmetic", "12+30=", "41", True),
    ("arithmetic", "12+30=", "4+1", False),
    ("sudoku", "12.4|3.1.|....|..3.", "1234341221434132", True),   # keeps the givens (not a solution)
    ("sudoku", "12.4|3.1.|....|..3.", "2134341221434132", False),  # changes a given
    ("sudoku", "12.4|3.1.|....|..3.", "123434122143413", False),   # 15 cells
])
def test_valid_says_whether_an_answer_is_well_formed(task_name, prompt, completion, valid):
    assert get_task(task_name).valid(prompt, completion) is valid


def test_the_trajectory_control_runs_from_the_cli_and_logs_what_the_rollouts_are(tmp_path):
    bgpo.main(tiny_argv(tmp_path, "--objective", "trajectory", "--remasking", "random", "--neg-weight", "0.5"))
    records = bgpo.read_log(tmp_path / "arithmetic_trajectory_random_u1_seed0" / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert 0 <= r["valid"] <= 1 and 0 <= r["solved"] <= 1 and r["entropy"] > 0 and r["grad_pos"] >= 0


def test_figures_hold_the_lines_they_draw_and_draw_a_png_when_matplotlib_is_there(tmp_path):
    records = [{"step": 0, "accuracy": 0.25, "eval_reward": 0.3}] + \
        [{"step": s, "reward": float(s), **({"accuracy": 0.5} if s == 3 else {})} for s in (1, 2, 3)]
    figure = bgpo.curves_figure({"run": records, "other run": records})
    reward, accuracy = (panel["lines"][0] for panel in figure["panels"])
    assert reward["x"] == [1, 2, 3] and reward["y"] == [1.0, 1.5, 2.0], "running mean of the rewards"
    assert [len(panel["lines"]) for panel in figure["panels"]] == [2, 2], "a line per run"
    each_step = bgpo.curves_figure({"run": records})["panels"][0]["lines"][0]
    assert each_step["y"] == [1.0, 2.0, 3.0], "a single run also shows each step's reward"
    assert accuracy["x"] == [0, 3] and accuracy["y"] == [0.25, 0.5]
    rows = [{"n_t": n, "naive_mb": 10.0 * n, "bgpo_mb": 10.0, "naive_s": 1.0, "bgpo_s": 0.5} for n in (1, 2)]
    memory, ratio = bgpo.memory_figure(rows)["panels"]
    assert [line["y"] for line in memory["lines"]] == [[10.0, 20.0], [10.0, 10.0]] and ratio["lines"][0]["y"] == [0.5, 0.5]
    pytest.importorskip("matplotlib")
    assert os.path.getsize(bgpo.draw(figure, str(tmp_path / "f.png"))) > 1000


def test_compare_draws_the_runs_named_and_a_missing_one_exits_2(tmp_path, capsys):
    bgpo.main(tiny_argv(tmp_path, "--rl-steps", "1"))
    bgpo.main(tiny_argv(tmp_path, "--compare", "arithmetic_bgpo_nt4_u1_seed0"))
    assert "compare.png" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bgpo.main(tiny_argv(tmp_path, "--compare", "mean=arithmetic_bgpo_nt4_u1_seed0,no_such_run"))
    assert e.value.code == 2 and "no_such_run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bgpo.main(tiny_argv(tmp_path, "--compare", "no_such_run"))
    assert e.value.code == 2 and "--compare: no log.jsonl" in capsys.readouterr().err


def test_mean_of_runs_averages_each_step_over_the_runs_that_have_it():
    a = [{"step": 0, "accuracy": 0.2}, {"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.1, "accuracy": 0.4}]
    b = [{"step": 0, "accuracy": 0.4}, {"step": 1, "reward": 0.3}, {"step": 2, "reward": 0.3}]
    assert bgpo.mean_of_runs([a, b]) == [{"step": 0, "accuracy": pytest.approx(0.3)}, {"step": 1, "reward": pytest.approx(0.4)},
                                         {"step": 2, "reward": pytest.approx(0.2)}]


def test_bench_estimators_runs_from_the_command_line_and_its_exact_columns_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(estimators, "N_T", (1, 4))                          # fewer rows: the pipeline, not the numbers
    monkeypatch.setattr(estimators, "REPEATS", 2)
    monkeypatch.setattr(estimators, "lab_batch", lambda task: (2, 4))
    monkeypatch.setattr(estimators, "MAX_PROMPT_MASKED", 0)                  # d1's 2^12 prompt masks: tested above
    bgpo.main(tiny_argv(tmp_path, "--bench-estimators", "--task", "countdown", "--sft-steps", "20"))  # SFT first
    result = json.loads((tmp_path / "estimators_countdown.json").read_text())
    rows = result["likelihood"]
    for name in ("ELBO, stratified (BGPO)", "antithetic pair (ours)"):          # unbiased: exactly the ELBO
        assert np.allclose(rows[name]["mean"], result["elbo"], atol=1e-5), name
    assert np.allclose(rows["dTRPO, 1 step per block"]["mean"], rows["trajectory, all steps"]["mean"], atol=1e-5)
    assert result["gradient"]["BGPO = naive (ELBO)"]["own_vs_elbo"] == 0.0
    assert [row["n_t"] for row in result["signal_to_noise"]] == [1, "inf"]


def test_sft_prints_progress_every_30_seconds_when_the_bar_is_hidden(tmp_path, capsys, monkeypatch):
    clock = itertools.count(0.0, 20.0)                                     # every reading of the clock: 20 s later
    monkeypatch.setattr(bgpo.time, "time", lambda: next(clock))
    bgpo.run_sft(tiny_args(tmp_path, "--sft-steps", "10"), get_task("arithmetic"))   # capsys: not a terminal
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("SFT step")]
    assert len(lines) >= 5 and lines[-1].startswith("SFT step 10/10"), lines


def test_resume_gives_the_same_result_as_an_uninterrupted_run(tmp_path):
    argv = tiny_argv(tmp_path)
    bgpo.main(argv + ["--rl-steps", "4", "--run-name", "straight"])
    bgpo.main(argv + ["--rl-steps", "2", "--run-name", "interrupted"])
    bgpo.main(argv + ["--rl-steps", "4", "--run-name", "interrupted", "--resume", "--stage", "rl"])
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "interrupted" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 4
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for run in ("straight", "interrupted"):                                # step 0 (the SFT model), then 1-4
        assert [r["step"] for r in bgpo.read_log(tmp_path / run / "log.jsonl")] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("extra, message", [
    (["--task", "chess"], "unknown task"),
    (["--sft-steps", "0"], "positive integer"),
    (["--mc-samples", "4", "--mc-chunk", "8"], "larger than --mc-samples"),
    (["--group-size", "1"], "at least 2"),
    (["--updates-per-batch", "0"], "at least 1"),
    (["--resume", "--run-name", "nothing-here"], "no run to resume"),
    (["--rl-pool", "1"], "smaller than --prompts-per-step"),
    (["--rl-pool", "-1"], "integer >= 0"),
    (["--rl-warmup", "-3"], "integer >= 0"),
    (["--neg-weight", "1.5"], "--neg-weight must be in [0, 1]"),
    (["--objective", "trajectory", "--updates-per-batch", "2"], "on-policy"),
    (["--stp-tau", "0.5"], "--stp-tau is an option of --objective stp, not bgpo"),
    (["--objective", "stp", "--stp-tau", "0"], "--stp-tau must be in (0, 1]"),
    (["--d1-advantages"], "--d1-advantages is an option of --objective diffu-grpo"),
    (["--objective", "dtrpo", "--no-anchors"], "--no-anchors is an option of --objective stp"),
    (["--objective", "diffu-grpo", "--mc-chunk", "2"], "--mc-chunk is an option of --objective bgpo"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        tiny_args(tmp_path, *extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    real, updates = bgpo.rl_update, []

    def nan_from_second_step(*args):
        updates.append(1)
        return real(*args) if len(updates) == 1 else (float("nan"), {})

    monkeypatch.setattr(bgpo, "rl_update", nan_from_second_step)
    with pytest.raises(bgpo.RunError, match="at RL step 2.*step 1"):
        bgpo.main(tiny_argv(tmp_path, "--rl-steps", "3"))
    kept = torch.load(tmp_path / "arithmetic_bgpo_nt4_u1_seed0" / "ckpt.pt", weights_only=True)
    assert kept["step"] == 1


# -----------------------------------------------------------------------------
# The field's RL objectives (estimators.py, section 4): diffu-GRPO, STP, dTRPO


def logp_given(model, prompts, inputs, targets):
    """log p(targets_i | prompts, inputs) at every completion position, straight from the model: (B, L)."""
    logits = model(torch.cat([prompts, inputs], 1))[:, prompts.shape[1]:]
    return logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]


def clipped_by_hand(ratios, A, eps):
    """-mean of min(r A, clip(r, 1 - eps, 1 + eps) A) over a list of (ratio, advantage) pairs."""
    return -np.mean([min(r * a, min(max(r, 1 - eps), 1 + eps) * a) for r, a in zip(ratios, A)])


DELTA = torch.tensor([[0.5, -0.1, 0.05, -0.6], [0.3, -0.4, 0.0, 0.15]], dtype=torch.float64)  # log-ratios inside and outside the clip
ADV = torch.tensor([1.5, -0.7], dtype=torch.float64)


def test_diffu_grpo_loss_equals_the_per_token_clipped_ratio_worked_out_by_hand():
    model, (x, y) = tiny_model(), random_batch(B=2, P=3, L=4)
    hide = torch.tensor([[False, True, False], [True, False, True]])
    everything = torch.full_like(y, 1)                                     # MASK = 1
    hand = logp_given(model, x.masked_fill(hide, 1), everything, y).detach()
    loss = estimators.diffu_grpo_loss(model, x, y, hide, hand - DELTA, ADV, clip_eps=0.5)
    expected = clipped_by_hand(DELTA.exp().flatten().tolist(), ADV.repeat_interleave(4).tolist(), 0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_stp_loss_equals_the_per_token_clipped_ratio_of_the_weighted_copies_worked_out_by_hand():
    model, (x, y) = tiny_model(), random_batch(B=2, P=3, L=4)
    mask = torch.tensor([[[True, False, True, False], [False, False, False, True]],
                         [[True, True, False, False], [True, True, True, False]]])  # (B, n = 2, L)
    weight = torch.tensor([[2.0, 4.0], [1.5, 1.0]])
    hand = sum(weight[:, j, None] * mask[:, j] * logp_given(model, x, y.masked_fill(mask[:, j], 1), y)
               for j in range(2)).detach() / 2
    loss = estimators.stp_loss(model, x, y, bgpo.MCSamples(mask, weight), hand - DELTA, ADV, clip_eps=0.2)
    expected = clipped_by_hand(DELTA.exp().flatten().tolist(), ADV.repeat_interleave(4).tolist(), 0.2)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_dtrpo_loss_equals_the_sequence_clipped_ratio_of_one_step_worked_out_by_hand():
    model, (x, y) = tiny_model(), random_batch(B=2, P=3, L=4)
    commit = torch.tensor([[2, 0, 3, 1], [1, 1, 0, 2]])
    steps = torch.tensor([[2], [1]])                                       # one block: one step each
    # row 0: 4 steps; at step 2 positions {0, 2} are masked and 0 is committed. Row 1: 3 steps; at
    # step 1 positions {0, 1, 3} are masked and 0, 1 are committed
    lp0 = logp_given(model, x[:1], y[:1].masked_fill(torch.tensor([[True, False, True, False]]), 1), y[:1])[0]
    lp1 = logp_given(model, x[1:], y[1:].masked_fill(torch.tensor([[True, True, False, True]]), 1), y[1:])[0]
    hand = torch.stack([4 * lp0[0], 3 * (lp1[0] + lp1[1])]).detach()
    delta = torch.tensor([0.1, -0.5])                                      # per-token log-ratios: x L = 4
    loss = estimators.dtrpo_loss(model, x, y, commit, steps, hand - 4 * delta, ADV, clip_eps=0.2)
    assert loss.item() == pytest.approx(clipped_by_hand(delta.exp().tolist(), ADV.tolist(), 0.2), rel=1e-12)


def test_dtrpo_dpo_loss_is_minus_log_sigmoid_of_beta_margin_and_has_no_gradient_for_equal_pairs():
    model, reference, (x, y) = tiny_model(), tiny_model(seed=1), random_batch(B=1, P=3, L=4)
    win, lose = y, y.flip(1)
    c_win, c_lose = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[3, 2, 1, 0]])
    steps = (torch.tensor([[1]]), torch.tensor([[0]]))
    # win at step 1: positions 1-3 masked, position 1 committed; lose at step 0: all masked, position 3 committed
    state_w, state_l = torch.tensor([[False, True, True, True]]), torch.ones(1, 4, dtype=torch.bool)

    def R(m):
        return (4 * logp_given(m, x, win.masked_fill(state_w, 1), win)[0, 1]
                - 4 * logp_given(m, x, lose.masked_fill(state_l, 1), lose)[0, 3]).item()
    margin = R(model) - R(reference)
    loss = estimators.dtrpo_dpo_loss(model, reference, x, win, c_win, lose, c_lose, beta=0.5, steps=steps)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * margin))), rel=1e-12)

    model.zero_grad()
    estimators.dtrpo_dpo_loss(model, reference, x, win, c_win, win, c_win, beta=0.5, steps=(steps[0], steps[0])).backward()
    assert grads(model).abs().max().item() == 0.0, "equal pairs: the two log-ratios cancel"


def test_each_field_objective_has_the_on_policy_gradient_of_its_estimate_on_the_same_draws():
    """On-policy (inner update 0), every loss has the gradient of -mean_b A_b X_b / L, X the estimate."""
    model, (x, _) = tiny_model(), random_batch(B=4, P=3, L=5)
    y, commit = generate(model, x, 5, temperature=1.0, generator=torch.Generator().manual_seed(0), return_steps=True)
    A = torch.tensor([1.0, -0.5, 0.3, -0.8])
    estimate = {"diffu-grpo": lambda r: estimators.one_step_log_likelihood(model, x.masked_fill(r["prompt_mask"][:, 0], 1), y),
                "stp": lambda r: estimators.stp_token_log_likelihood(model, x, y, r["mc"][0]).sum(1),
                "dtrpo": lambda r: estimators.dtrpo_log_likelihood(model, x, y, commit, steps=r["steps"][:, 0])}
    for objective, X in estimate.items():
        rollout = estimators.field_rollout(model, objective, x, y, commit, 2, torch.Generator().manual_seed(1))
        model.zero_grad()
        estimators.field_loss(model, objective, x, y, rollout, A, 0, clip_eps=0.2).backward()
        g_loss = grads(model).clone()
        model.zero_grad()
        (-(A * X(rollout)).mean() / 5).backward()
        assert torch.allclose(g_loss, grads(model), rtol=1e-10, atol=1e-13), f"{objective}: {report(g_loss, grads(model))}"


def test_diffu_grpo_old_and_current_policy_see_the_same_prompt_mask_and_inner_updates_different_ones():
    model, (x, y) = tiny_model(), random_batch(B=8, P=6, L=4)
    seen = []
    model.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0][:, :6].clone()))
    rollout = estimators.field_rollout(model, "diffu-grpo", x, y, None, 3, torch.Generator().manual_seed(0))
    old = seen[:]                                                          # the old policy, one pass per inner update
    for j in range(3):
        estimators.field_loss(model, "diffu-grpo", x, y, rollout, torch.ones(8), j, clip_eps=0.5)
        assert torch.equal(seen[-1], old[j]), f"inner update {j} sees the prompt mask its old values were computed on"
        assert (seen[-1] == 1).any(), "some prompt tokens are masked (p = 0.15 of 48)"
    assert not torch.equal(old[0], old[1]) and not torch.equal(old[1], old[2]), "each inner update has its own mask"


def test_stp_rollout_never_changes_an_anchor_and_its_early_stop_leaves_no_mask_in_fewer_passes():
    model, (x, _) = tiny_model(max_len=3 + 8), random_batch(B=16, P=3, L=8)
    g = torch.Generator().manual_seed(0)
    anchors = torch.rand(16, 8, generator=g) < 0.3
    prior = torch.randint(2, 10, (16, 8), generator=g).masked_fill(~anchors, 1)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    y, commit = generate(model, x, 8, temperature=1.0, generator=g, return_steps=True, prior=prior, early_stop=0.5)
    assert torch.equal(y[anchors], prior[anchors]) and (commit[anchors] == -1).all(), "anchors: in place, never committed"
    assert not (y == 1).any() and (commit[~anchors] >= 0).all(), "the early stop filled every masked position"
    passes = int(commit.max()) + 1
    assert len(calls) == passes < 8, f"{len(calls)} forward passes, one per step that committed something, and the fill"
    placed_before_fill = anchors.sum(1) + ((commit >= 0) & (commit < passes - 1)).sum(1)
    assert (placed_before_fill >= 4).all(), "a row stops once int(0.5 * 8) tokens are in place"


def test_d1_advantages_are_the_reward_minus_the_group_mean():
    A = estimators.d1_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5]), 3)
    assert torch.allclose(A, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1 / 3, 1 / 6, 1 / 6]))


@pytest.fixture(scope="module")
def shared_out(tmp_path_factory):
    return tmp_path_factory.mktemp("field")


@pytest.mark.parametrize("objective, extra", [("diffu-grpo", ["--d1-advantages"]), ("stp", ["--stp-tau", "0.5"]),
                                              ("dtrpo", [])])
def test_two_rl_steps_run_for_each_field_objective(shared_out, objective, extra):
    tmp_path = shared_out                                                  # one SFT model for the three runs
    history = bgpo.main(tiny_argv(tmp_path, "--objective", objective, *extra))
    assert [h["step"] for h in history] == [0, 1, 2]
    run = {"diffu-grpo": "diffu-grpo_d1adv_u4", "stp": "stp_nt4_tau0.5_u4", "dtrpo": "dtrpo_u4"}[objective]
    records = bgpo.read_log(tmp_path / f"arithmetic_{run}_seed0" / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    passes = [r["rollout_passes"] for r in records[1:]]
    assert passes == ([3, 3] if objective == "stp" else [4, 4]), "STP: 2 of 4 tokens, then one pass fills the rest"
