"""
The tutorial's claims as tests: each computes one quantity two independent ways (or against a value
worked out by hand). All run on CPU in seconds, most in float64 on tiny models. The lab's tests
are in lab/test_*.py; one command runs both.

    python -m pytest -q                     # all of them, with the lab's
    python -m pytest -q -s -k equivalence   # the on-policy equivalence demos, printing what each compares
"""
import contextlib
import copy
import datetime
import itertools
import json
import math
import multiprocessing
import multiprocessing.forkserver
import os
import re
import runpy
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import bgpo
import tasks
import tiny_dllm
from bgpo import (bgpo_backward, bgpo_bound, draw_mc_samples, elbo_terms, group_advantages, naive_loss,
                  naive_objective)
from tasks import TOKENIZER, get_task
from tiny_dllm import (ActivationMemory, ModelConfig, TinyDLLM, count_offsets, forward_process, generate,
                       masked_log_likelihood, sft_loss)

TASK_NAMES = ["arithmetic", "countdown", "sudoku"]

@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)

TINY_SFT_BATCH = 32

@pytest.fixture(autouse=True)
def small_sft_batches(monkeypatch):
    """The tiny models' SFT draws batches of 32 demonstrations instead of SFT_BATCH's 128: as much as they
    learn from, in a quarter of the time (the SFT checkpoint's name records the batch)."""
    monkeypatch.setattr(bgpo, "SFT_BATCH", TINY_SFT_BATCH)

def tiny_model(seed=0, vocab_size=10, max_len=12, scale=0.5):
    """A random model whose conditionals differ clearly from position to position."""
    torch.manual_seed(seed)
    model = TinyDLLM(ModelConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=16, max_len=max_len,
                                 mask_id=1))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=scale)
    return model

def random_batch(B=6, P=3, L=5, vocab_size=10, seed=0):
    """Prompts and completions of ordinary tokens (ids 2.., never MASK=1)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab_size, (B, P), generator=generator)
    completions = torch.randint(2, vocab_size, (B, L), generator=generator)
    return prompts, completions

def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])

def read_log(path):
    return [json.loads(line) for line in open(path)]

def report(a, b):
    diff = (a - b).abs()
    return f"max |diff| {diff.max().item():.3g}, mean |diff| {diff.mean().item():.3g}"

def masked_sums_under_every_mask(model, prompt, completion):
    """For one prompt (P,) and completion (L,): every non-empty set S of masked positions as a (N, L) bool
    row (N = 2^L - 1; row r is bitmask r + 1), and a(S) = sum_{i in S} log p(y^i | y with S masked, x)."""
    L = completion.shape[0]
    masks = ((torch.arange(1, 2**L)[:, None] >> torch.arange(L)) & 1).bool()
    N = len(masks)
    return masks, masked_log_likelihood(model, prompt.expand(N, -1), completion.expand(N, L), masks)  # (N,)

def exact_elbo(model, prompt, completion):
    """The ELBO by enumerating the 2^L - 1 mask sets, the tests' ground truth:
    ELBO = sum_{k=1..L} (1/k) mean_{|S|=k} a(S) = sum_S a(S) / (k C(L, k)), k = |S|. Differentiable."""
    masks, a = masked_sums_under_every_mask(model, prompt, completion)
    k = masks.sum(1)
    return (a / (k * torch.tensor([math.comb(masks.shape[1], int(j)) for j in k]).to(a))).sum()

# The model and the sampler ----------------------------------------------------------------------------------

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
    # sft_loss = -(1/L) mean_b (L/k_b) * that sum, for the mask its generator draws (one copy each)
    mask, weight = (v[:, 0] for v in forward_process(3, 5, 1, torch.Generator().manual_seed(7)))
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

# Tasks: tokenizer, splits and rewards -----------------------------------------------------------------------

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
def test_train_validation_and_test_splits_are_disjoint(name):
    task = get_task(name)
    if name == "sudoku":  # split by solution grid
        key = lambda p, a: a
    elif name == "countdown":  # the same numbers in another order are the same problem
        key = lambda p, a: (tuple(sorted(p.split(":")[0].split(","))), p.split(":")[1])
    else:
        key = lambda p, a: p
    keys = {}
    for i, split in enumerate(("train", "validation", "test")):
        prompts, answers = task.sample(1000 if split == "train" else 200, split, i)
        assert all(task.reward(p, a) == 1.0 for p, a in zip(prompts, answers)), (
            "reference answers must score 1")
        keys[split] = set(map(key, prompts, answers))
    for a, b in itertools.combinations(keys, 2):
        assert not keys[a] & keys[b], f"{name}: {a} and {b} share problems"

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

def test_every_prompt_matches_its_tasks_pattern_and_others_do_not():
    for name in TASK_NAMES:
        task = get_task(name)
        for split in ("train", "test"):
            assert all(re.fullmatch(task.prompt_pattern, p) for p in task.sample(200, split, 0)[0]), name
    assert not re.fullmatch(get_task("countdown").prompt_pattern, "15,4:64")
    assert not re.fullmatch(get_task("sudoku").prompt_pattern, "12.4|3.1.|....|..5.")

# The ELBO: exact value by enumeration, and its Monte Carlo estimates ----------------------------------------

def test_exact_elbo_by_enumeration_equals_the_mean_over_mask_counts_by_hand():
    """At L = 2 the ELBO is a short sum: k = 1 or 2 with probability 1/2 each; k = 1 masks one of the two
    positions (probability 1/2 each) with weight L/k = 2, k = 2 masks both with weight 1."""
    model = tiny_model()
    x, y = random_batch(B=1, L=2)
    a = {S: masked_log_likelihood(model, x, y, torch.tensor([S], dtype=torch.bool))[0]
         for S in ((1, 0), (0, 1), (1, 1))}
    by_hand = 0.5 * 2 * (a[(1, 0)] + a[(0, 1)]) / 2 + 0.5 * 1 * a[(1, 1)]
    assert abs(exact_elbo(model, x[0], y[0]) - by_hand) < 1e-12

def test_stratified_mc_elbo_is_unbiased():
    """Stratified weights are at most L, so the estimate has finite variance and its mean over many draws
    lies within a few standard errors of the exact value."""
    model = tiny_model()
    x, y = random_batch(B=1)
    exact = exact_elbo(model, x[0], y[0])
    n = 20000
    with torch.no_grad():
        l = elbo_terms(model, x, y, draw_mc_samples(1, 5, n, torch.Generator().manual_seed(1)))[0]
    se = l.std() / math.sqrt(n)
    assert abs(l.mean() - exact) < 4 * se, f"MC {l.mean():.4f} vs exact {exact:.4f}, SE {se:.4f}"

def test_iid_draws_follow_their_law_whose_expectation_by_quadrature_is_the_exact_elbo():
    """The iid weight 1/t is unbounded and the estimate's variance infinite, so a sample mean against its
    standard error proves nothing. Instead: the draws follow the stated law (t ~ U(0, 1], each token masked
    with probability t, weight 1/t; checked on t and on the mask count, both of finite variance), and that
    law's exact expectation, integrated over t by Gauss-Legendre quadrature on the enumerated table,
        E = int_0^1 (1/t) sum_S t^|S| (1-t)^(L-|S|) a(S) dt,  a(S) = sum_{i in S} log p(y^i | S masked),
    equals exact_elbo (the integrand is a polynomial of degree L - 1: 16 nodes integrate it exactly)."""
    model, L = tiny_model(), 5
    x, y = random_batch(B=1, L=L)
    mc = draw_mc_samples(4000, L, 1, torch.Generator().manual_seed(1), "iid")
    t, count = 1 / mc.weight[:, 0], mc.mask[:, 0].sum(1).double()
    assert ((t > 0) & (t <= 1)).all()
    for name, z, mean in (("t", t, 0.5), ("count - L t", count - L * t, 0.0)):
        assert abs(z.mean() - mean) < 4 * z.std() / math.sqrt(len(z)), (
            f"{name}: mean {z.mean():.4f}, not {mean}")
    masks, a = masked_sums_under_every_mask(model, x[0], y[0])
    size = masks.sum(1)                                                    # |S| and a(S) for every set S
    nodes, weights = np.polynomial.legendre.leggauss(16)                   # on [-1, 1]: map to [0, 1]
    t_q, w_q = torch.tensor((nodes + 1) / 2)[:, None], torch.tensor(weights / 2)
    expectation = (w_q * (t_q ** (size - 1) * (1 - t_q) ** (L - size) * a).sum(1)).sum()
    exact = exact_elbo(model, x[0], y[0])
    assert abs(expectation - exact) < 1e-10, f"quadrature {expectation:.12f} vs exact {exact:.12f}"

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

def test_count_offsets_round_half_to_even_in_integers_as_a_reciprocal_would_not():
    """count_offsets(L, M) against Python's round(j L / M) (a correctly rounded quotient, so exact at halves)
    for every L, M < 130; and the float form it replaced, computed as CUDA divides by a host number (times
    its inverse): that one misses at L 3, M 98, j 49, where j L / M = 1.5 rounds to 2."""
    for L, M in itertools.product(range(1, 130), repeat=2):
        assert count_offsets(L, M).tolist() == [round(j * L / M) for j in range(M)], (L, M)
    by_inverse = (torch.arange(98, dtype=torch.float64) * 3 * (1 / 98)).round().long()
    assert by_inverse[49] == 1 and count_offsets(3, 98)[49] == 2 == round(49 * 3 / 98)

def test_each_stratified_count_is_uniform_where_llada_rounding_is_not():
    """Pooled law of the n_t mask counts, for every L <= 16 and n_t in {1..6, 8, 16}, two ways: this code's
    counts (read off forward_process: k_0, the first copy's count, then each copy's count given k_0) and
    LLaDA's get_log_likelihood.py formula, counts = ((round(linspace(k_0, k_0 + (n_t - 1) L / n_t, n_t)) - 1)
    mod L) + 1, rounding half to even. Both should be uniform on 1..L for an unbiased ELBO estimate."""
    differ = []
    for L, n_t in itertools.product(range(1, 17), [1, 2, 3, 4, 5, 6, 8, 16]):
        k = forward_process(60 * L, L, n_t, torch.Generator().manual_seed(L))[0].sum(-1)  # (B, M)
        ours = {int(row[0]): row.tolist() for row in k}
        assert sorted(ours) == list(range(1, L + 1)), (L, n_t, "some k_0 was never drawn")
        assert all(ours[int(row[0])] == row.tolist() for row in k), "a copy's count is a function of k_0"
        llada = {k0: (((torch.linspace(k0, k0 + (n_t - 1) * L / n_t, n_t, dtype=torch.float64).round().long()
                       - 1) % L) + 1).tolist() for k0 in range(1, L + 1)}
        law = {name: torch.bincount(torch.tensor(sum(counts.values(), [])) - 1, minlength=L) / (L * n_t)
               for name, counts in (("ours", ours), ("llada", llada))}
        assert torch.allclose(law["ours"], torch.full((L,), 1 / L)), (L, n_t, law["ours"])
        half = any((2 * j * L) % n_t == 0 and (j * L) % n_t for j in range(n_t))   # some j L / n_t = m + 1/2
        if ours != llada:
            differ.append((L, n_t))
            assert half, f"L {L}, n_t {n_t}: LLaDA's counts differ without a half-integer j L / n_t"
        if L % n_t == 0:
            assert ours == llada, (L, n_t)
    llada_4_8 = torch.tensor([0.5, 1.5, 0.5, 1.5]) / 4                          # worked out by hand below
    counts = sum([((torch.linspace(k0, k0 + 3.5, 8, dtype=torch.float64).round().long() - 1) % 4 + 1).tolist()
                  for k0 in range(1, 5)], [])
    assert torch.allclose(torch.bincount(torch.tensor(counts) - 1) / 32, llada_4_8)
    print(f"LLaDA's count maps differ from this code's at {len(differ)} of 128 (L, n_t), all half-integer")
    assert len(differ) == 52, len(differ)

# The objectives: equivalence on-policy, the bound off-policy, memory ----------------------------------------

def on_policy_setup(M=6, seed=0):
    model = tiny_model(seed)
    x, y = random_batch(B=6)
    mc = draw_mc_samples(6, 5, M, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        old_terms = elbo_terms(model, x, y, mc)
    A = torch.tensor([1.5, -0.5, 0.0, -1.2, 0.7, 0.0])                   # positive, negative and zero
    return model, x, y, mc, old_terms, A

def test_equivalence_bgpo_value_equals_naive_on_policy():
    model, x, y, mc, old_terms, A = on_policy_setup()
    naive = naive_loss(model, x, y, mc, old_terms, A)
    bound = bgpo_backward(model, x, y, mc, old_terms, A)
    print(f"\n  on-policy loss: naive {naive.item():.15f}, BGPO {bound:.15f}, -mean(A) {-A.mean():.15f}")
    assert abs(naive.item() - bound) < 1e-12 and abs(bound + A.mean().item()) < 1e-12, (naive.item(), bound)

@pytest.mark.parametrize("mc_chunk", [1, 3, 6, 8])   # 8: more than n_t, all at once
def test_equivalence_bgpo_gradient_equals_naive_on_policy(mc_chunk):
    model, x, y, mc, old_terms, A = on_policy_setup()
    naive_loss(model, x, y, mc, old_terms, A).backward()
    g_naive = grads(model)
    model.zero_grad()
    bgpo_backward(model, x, y, mc, old_terms, A, mc_chunk=mc_chunk)
    g_bgpo = grads(model)
    rel = (g_naive - g_bgpo).norm() / g_naive.norm()
    print(f"\n  on-policy gradient, mc_chunk {mc_chunk}: |naive| {g_naive.norm():.12f}, |BGPO| "
          f"{g_bgpo.norm():.12f}, |naive - BGPO| / |naive| {rel:.2g}")
    assert rel < 1e-8, f"relative difference {rel:.3g}; {report(g_naive, g_bgpo)}"

@pytest.mark.parametrize("loss_of", ["bgpo", "naive"])
def test_equivalence_on_policy_old_terms_can_come_from_the_updates_own_forward(loss_of):
    """With one update per batch the old policy is the current one: old_terms=None (the update's own
    terms, detached) gives the gradient of a separate no-grad pass over the same masks."""
    model, x, y, mc, old_terms, A = on_policy_setup()
    grad = {}
    for name, old in (("separate pass", old_terms), ("own forward", None)):
        model.zero_grad()
        if loss_of == "bgpo":
            bgpo_backward(model, x, y, mc, old, A)
        else:
            naive_loss(model, x, y, mc, old, A).backward()
        grad[name] = grads(model)
    print(f"\n  {loss_of} gradient: {report(*grad.values())} between old terms from a separate pass and "
          "from the update's own forward")
    assert grad["own forward"].abs().max() > 1e-3
    assert torch.allclose(grad["separate pass"], grad["own forward"], rtol=1e-10, atol=1e-12), \
        report(*grad.values())

def test_equivalence_bgpo_gradient_under_bf16_autocast_matches_the_float32_naive_gradient_on_policy():
    """The GPU path (--dtype bfloat16, CUDA's default from Ampere on): BGPO's update under bf16 autocast, as
    main runs it, against the naive objective's in float32, on-policy, on the default model and a Countdown
    batch.
    bf16 keeps 7 bits of fraction (a rounding of up to 2^-8 = 0.4% per value), so the two gradients differ by
    about that: within 2% (0.48% measured here). The ELBO terms stay float32."""
    torch.set_default_dtype(torch.float32)   # the float64 fixture restores its dtype after the test
    task, args = get_task("countdown"), bgpo.parse_args(["--device", "cpu", "--dtype", "bfloat16"])
    torch.manual_seed(0)
    model = bgpo.make_model(task, args)
    x, y = bgpo.encode(task, *task.sample(16, "train", 0))
    mc = draw_mc_samples(16, task.gen_len, 8, torch.Generator().manual_seed(0))
    A = group_advantages(torch.rand(16, generator=torch.Generator().manual_seed(1)), 8)
    grad = {}
    for name, dtype in [("naive, float32", "float32"), ("BGPO, float32", "float32"),
                        ("BGPO, bf16", "bfloat16")]:
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext():
            assert elbo_terms(model, x, y, mc).dtype == torch.float32
            if name.startswith("naive"):
                naive_loss(model, x, y, mc, None, A).backward()
            else:
                bgpo_backward(model, x, y, mc, None, A)
        grad[name] = grads(model)
    rel = {name: ((g - grad["naive, float32"]).norm() / grad["naive, float32"].norm()).item()
           for name, g in grad.items()}
    print(f"\n  on-policy gradient, |g - naive float32| / |naive float32|: BGPO float32 "
          f"{rel['BGPO, float32']:.2g}, BGPO under bf16 autocast {rel['BGPO, bf16']:.2g}")
    assert rel["BGPO, float32"] < 1e-5, rel
    assert 1e-4 < rel["BGPO, bf16"] < 2e-2, rel   # above 1e-4: bf16 did run (float32 agrees to 1e-7)

def test_under_bf16_every_forward_pass_runs_in_autocast_and_no_optimizer_step_does(tmp_path, monkeypatch):
    """--dtype bfloat16: autocast casts each weight to bf16 once a region and keeps that copy until the region
    ends, so an optimizer step inside a region would leave the model computing with its old weights (an
    earlier bgpo.py had one region around the whole run; its bf16 runs computed with their first weights).
    Over a tiny run (SFT with its evaluations, then RL): every forward pass under autocast, every optimizer
    step outside it."""
    torch.set_default_dtype(torch.float32)   # the float64 fixture restores its dtype after the test
    forwards, steps = [], []
    forward, step = TinyDLLM.forward, torch.optim.AdamW.step
    monkeypatch.setattr(TinyDLLM, "forward", lambda self, tokens: forwards.append(
        torch.is_autocast_enabled("cpu")) or forward(self, tokens))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(
        torch.is_autocast_enabled("cpu")) or step(self, *a, **k))
    real = bgpo.sample_rollouts
    monkeypatch.setattr(bgpo, "sample_rollouts", lambda *a: (*real(*a)[:2], torch.arange(8) % 2.0))  # signal
    bgpo.main(tiny_argv(tmp_path, "--dtype", "bfloat16", "--sft-steps", "4", "--sft-eval-every", "2"))
    assert len(steps) == 4 + 2 and not any(steps), steps          # SFT's 4 steps, RL's 2
    assert len(forwards) > 20 and all(forwards), f"{forwards.count(False)} of {len(forwards)} in float32"

def test_no_optimizer_or_gradient_clip_asks_for_foreach_kernels_which_apple_mps_lacks(tmp_path, monkeypatch):
    """PyTorch's clip_grad_norm_ raises on MPS tensors when given foreach=True (torch/nn/utils/clip_grad.py:
    "can't use the foreach API on mps tensors"), as _device_has_foreach_support lists no "mps". Left at
    None, PyTorch picks its foreach kernels where the device has them and a loop elsewhere. Over a tiny SFT +
    RL run, no call asks for them."""
    from torch.utils._foreach_utils import _device_has_foreach_support
    assert not _device_has_foreach_support(torch.device("mps")), "MPS has foreach kernels now"
    asked = []
    adamw, clip = torch.optim.AdamW.__init__, torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.optim.AdamW, "__init__", lambda self, *a, foreach=None, **k: asked.append(
        ("AdamW", foreach)) or adamw(self, *a, foreach=foreach, **k))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, foreach=None, **k: asked.append(
        ("clip_grad_norm_", foreach)) or clip(*a, foreach=foreach, **k))
    real = bgpo.sample_rollouts
    monkeypatch.setattr(bgpo, "sample_rollouts", lambda *a: (*real(*a)[:2], torch.arange(8) % 2.0))  # signal
    bgpo.main(tiny_argv(tmp_path, "--sft-steps", "2", "--sft-eval-every", "2"))
    assert sorted(set(asked)) == [("AdamW", None), ("clip_grad_norm_", None)], asked
    assert len(asked) == 2 + 2 + 2, "SFT's and RL's optimizer, 2 SFT steps' clips, 2 RL steps' clips"

def test_equivalence_naive_gradient_is_the_sum_of_one_backward_per_mc_sample_on_policy():
    """On-policy every d_j = 0, so grad R_hat = (A / n_t) sum_j grad l_j / L: the naive objective's gradient
    is n_t separate backward passes, one per MC sample, added up. Written out by hand here, in a loop."""
    model, x, y, mc, old_terms, A = on_policy_setup()
    naive_loss(model, x, y, mc, old_terms, A).backward()
    one_graph = grads(model)
    model.zero_grad()
    n_t, L = mc.weight.shape[1], y.shape[1]
    for j in range(n_t):
        l_j = elbo_terms(model, x, y, mc[j:j + 1])[:, 0]                  # (B,) one sample's term, its graph
        (-(A * l_j / L).mean() / n_t).backward()                          # freed here, before the next
    rel = ((grads(model) - one_graph).norm() / one_graph.norm()).item()
    print(f"\n  on-policy: one graph over {n_t} samples vs {n_t} backward passes added: relative {rel:.2g}")
    assert rel < 1e-12, rel

def test_clipping_is_inactive_on_policy():
    model, x, y, mc, old_terms, A = on_policy_setup()
    bgpo_backward(model, x, y, mc, old_terms, A)
    grad = grads(model)
    model.zero_grad()
    bgpo_backward(model, x, y, mc, old_terms, A, clip_eps=0.2, mc_chunk=2)
    assert torch.allclose(grad, grads(model), rtol=1e-10, atol=1e-14), report(grad, grads(model))

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

def test_the_naive_gradient_can_be_accumulated_one_mc_sample_at_a_time_off_policy():
    """What costs memory is the one-graph computation, not the naive gradient: grad R_hat =
    A exp(mean_j d_j) (1/n_t) sum_j grad d_j, so a pass without gradients that gives each sequence
    c = A exp(mean_j d_j) / n_t lets the exact gradient be accumulated one sample at a time. Off-policy
    it equals naive_loss(...).backward(); BGPO's bound has another gradient."""
    model, x, y, mc, old_terms, A = on_policy_setup()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    n_t, L = mc.weight.shape[1], y.shape[1]
    naive_loss(model, x, y, mc, old_terms, A).backward()
    one_graph = grads(model)
    model.zero_grad()
    with torch.no_grad():                                                 # pass 1: c per sequence, no graph
        c = A * ((elbo_terms(model, x, y, mc) - old_terms) / L).mean(1).exp() / n_t
    for j in range(n_t):                                                  # pass 2: one sample at a time
        d_j = (elbo_terms(model, x, y, mc[j:j + 1])[:, 0] - old_terms[:, j]) / L
        (-(c * d_j).mean()).backward()
    two_pass = grads(model)
    model.zero_grad()
    bgpo_backward(model, x, y, mc, old_terms, A)
    rel = {name: ((g - one_graph).norm() / one_graph.norm()).item()
           for name, g in (("two-pass", two_pass), ("BGPO", grads(model)))}
    print(f"relative difference from the one-graph naive gradient: {rel}")
    assert rel["two-pass"] < 1e-12 and rel["BGPO"] > 1e-3, rel

def test_equivalence_bgpo_activation_memory_is_flat_and_naive_grows_with_n_t():
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

def test_an_update_that_fails_mid_forward_leaves_no_saved_tensor_behind():
    """Out of memory halfway through a forward, no backward frees the graph built so far. Under the meter's
    hooks that graph and the meter's handles hold each other, so leaving the with block must free it: on a
    GPU the leak made every later row of the memory table run out of memory too."""
    model, x, y, mc, old_terms, A = on_policy_setup(8)
    last_block = model.blocks[-1]

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("simulated")

    last_block.forward = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        with ActivationMemory(model) as memory:
            naive_loss(model, x, y, mc, old_terms, A).backward()
    assert memory.peak > 0 and memory.current == 0 and not memory.live, (memory.peak, memory.current)

def test_no_nan_or_inf_for_extreme_log_ratios_in_float32():
    """In float32, training's dtype, exp(d) overflows for d > 88: where A >= 0 the bound must never take
    exp(d) (torch.where would backpropagate 0 * inf = NaN through the branch it does not use)."""
    d = torch.tensor([[-1.0, -3.0, 30.0, 0.0], [-50.0, 2.0, 25.0, -1.0], [700.0, 1.0, -1.5, 0.0]],
                     dtype=torch.float32, requires_grad=True)
    A = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float32)
    for clip_eps in (None, 0.2):
        value = bgpo_bound(d, A, 4, clip_eps).sum()   # 1 + d for A >= 0: never log(1 + d), never exp(700)
        (grad,) = torch.autograd.grad(value, d)
        assert torch.isfinite(value) and torch.isfinite(grad).all(), (value, grad)
        value = naive_objective(d[:2], A[:2], clip_eps).sum()
        (grad,) = torch.autograd.grad(value, d)
        assert torch.isfinite(value) and torch.isfinite(grad).all(), (value, grad)
    # hand values: A=1 row: (1 + d_j) / 4; A=-1 row: -e^{d_j} / 4
    expected = torch.stack([(1 + d[0]) / 4, -d[1].exp() / 4])   # 1 + d where A >= 0, e^d where A < 0
    assert torch.allclose(bgpo_bound(d[:2], A[:2], 4), expected)

def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1])
    A = group_advantages(r, 4)
    std = math.sqrt(((0.75 ** 2) + 3 * 0.25 ** 2) / 3)                    # unbiased std of (1, 0, 0, 0)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6)
    assert torch.allclose(A[:4], expected) and (A[4:] == 0).all(), A

def test_paired_gain_by_hand():
    """Five problems, solved before [1, 0, 0, 1, 0] and after [1, 1, 0, 0, 1]: differences [0, 1, 0, -1, 1],
    mean 0.2; squared deviations 0.04 + 0.64 + 0.04 + 1.44 + 0.64 = 2.8, variance 2.8 / 4 = 0.7; so the 95%
    half-width is 1.96 sqrt(0.7 / 5) = 0.7334."""
    gain, half = bgpo.paired_gain([1, 0, 0, 1, 0], [1, 1, 0, 0, 1])
    assert abs(gain - 0.2) < 1e-12 and abs(half - 1.96 * math.sqrt(0.7 / 5)) < 1e-12, (gain, half)
    assert bgpo.paired_gain([1, 0, 1], [1, 0, 1]) == (0.0, 0.0), "the same outcomes: no gain, no doubt"
    with pytest.raises(ValueError):
        bgpo.paired_gain([1, 0], [1, 0, 1])                                # not the same problems

def test_a_runs_first_and_last_lines_say_its_size_and_its_gain_with_an_interval(tmp_path, capsys):
    """The first line names the size and why (--size auto on the CPU: the CPU size). The final line's
    accuracies are the loop's step-0 and last evaluations, and its interval is paired_gain of the two models'
    outcomes on those problems."""
    argv = tiny_argv(tmp_path)
    history = bgpo.main(argv)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"task arithmetic | device cpu | seed 0 | size cpu{cpu_size_why()}", out[0]
    line = [l for l in out if " RL steps: " in l][-1]
    before, after, gain, low, high = map(float, re.findall(r"[-+]?\d+\.\d", line)[:5])
    assert (before, after) == tuple(round(100 * h["accuracy"], 1) for h in (history[0], history[-1]))
    args, task = bgpo.parse_args(argv), get_task("arithmetic")
    problems = bgpo.test_problems(task, args)
    outcomes = [bgpo.evaluate(bgpo.load_model(path, task, args), task, problems, args)["solved"]
                for path in (bgpo.sft_path(args), tmp_path / args.run_name / "ckpt.pt")]
    mean, half = bgpo.paired_gain(*outcomes)
    assert (gain, low, high) == tuple(round(100 * v, 1) for v in (mean, mean - half, mean + half)), line

def test_bad_shapes_raise_value_errors_naming_the_argument():
    model, x, y, mc, old_terms, A = on_policy_setup()
    cases = {"completions": dict(completions=y[:5]), "old_terms": dict(old_terms=old_terms[:, :5]),
             "advantages": dict(advantages=A[:, None]),
             "mc.mask": dict(mc=bgpo.MCSamples(mc.mask[:, :, :4], mc.weight)),
             "prompts": dict(prompts=x[0])}
    for name, override in cases.items():
        kwargs = {**dict(model=model, prompts=x, completions=y, mc=mc, old_terms=old_terms, advantages=A),
                  **override}
        for fn in (naive_loss, bgpo_backward):
            with pytest.raises(ValueError, match=name.replace(".", r"\.")):
                fn(**kwargs)
    with pytest.raises(ValueError, match="advantages"):
        bgpo_backward(model, x, y, mc, old_terms, torch.full((6,), float("nan")))
    with pytest.raises(ValueError, match="mc_chunk"):
        bgpo_backward(model, x, y, mc, old_terms, A, mc_chunk=0)
    with pytest.raises(ValueError, match="n_t"):
        draw_mc_samples(6, 5, 0)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), 4)

# The script: SFT, checkpoints, the RL loop, resume, the command line ----------------------------------------

def tiny_argv(tmp_path, *extra):
    """Command-line flags for a model and run small enough to train in seconds."""
    return ["--task", "arithmetic", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--sft-steps", "100",
            "--prompts-per-step", "2", "--group-size", "4", "--mc-samples", "4", "--rl-steps", "2",
            "--eval-size", "8", "--eval-every", "1", "--val-size", "16", "--sft-eval-every", "50",
            "--out-dir", str(tmp_path), "--device", "cpu", *extra]

def tiny_args(tmp_path, *extra):
    return bgpo.parse_args(tiny_argv(tmp_path, *extra))

def cpu_size_why():
    """The first line's reason for the CPU size under --device cpu, which depends on what PyTorch sees
    (.ci/run runs the suite on a machine that sees a card too, simulated: lab/simulated_cuda)."""
    return " (--size auto: " + ("--device cpu" if torch.cuda.is_available() else "no CUDA device") + ")"

def test_short_sft_lowers_the_loss_and_checkpoint_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(bgpo, "SFT_LR", 3e-3)                           # a 1-layer model learns faster
    args, task = tiny_args(tmp_path), get_task("arithmetic")
    x, y = bgpo.encode(task, *task.sample(256, "test", 0))
    torch.manual_seed(args.seed)                                          # run_sft's initial weights
    before = sft_loss(bgpo.make_model(task, args), x, y, torch.Generator().manual_seed(0)).item()
    model = bgpo.run_sft(args, task)
    after = sft_loss(model, x, y, torch.Generator().manual_seed(0)).item()
    assert after < 0.8 * before, f"held-out SFT loss {before:.3f} -> {after:.3f}"

    loaded = bgpo.load_model(bgpo.sft_path(args), task, args)
    tokens = torch.cat([x, y], 1)[:16]
    assert torch.equal(model(tokens), loaded(tokens))
    with pytest.raises(ValueError, match="made for task 'arithmetic'"):
        bgpo.load_checkpoint(bgpo.sft_path(args), get_task("countdown"))
    with pytest.raises(ValueError, match="made for task 'arithmetic' and model config"):
        bgpo.load_model(bgpo.sft_path(args), task, tiny_args(tmp_path, "--n-embd", "32"))
    with open(tmp_path / "broken.pt", "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        bgpo.load_checkpoint(str(tmp_path / "broken.pt"), task)

def test_the_sft_checkpoint_name_changes_with_every_setting_of_sft(tmp_path):
    """--stage all reuses an SFT checkpoint whose name matches: every flag that changes the kept model must
    change the name, and the flags that do not (RL's) must not."""
    base = bgpo.sft_path(tiny_args(tmp_path))
    for flag, value in [("--task", "countdown"), ("--seed", "1"), ("--demos", "7"), ("--sft-steps", "99"),
                        ("--sft-eval-every", "10"), ("--val-size", "17"), ("--n-layer", "2"),
                        ("--n-head", "4"), ("--n-embd", "32"), ("--out-dir", str(tmp_path / "other"))]:
        assert bgpo.sft_path(tiny_args(tmp_path, flag, value)) != base, flag
    for flag, value in [("--objective", "naive"), ("--mc-samples", "2"), ("--rl-steps", "5"),
                        ("--eval-size", "9"), ("--minibatches", "2"), ("--eval-every", "3")]:
        assert bgpo.sft_path(tiny_args(tmp_path, flag, value)) == base, flag

def test_a_folder_that_holds_a_run_is_refused_without_resume_or_overwrite(tmp_path):
    argv = tiny_argv(tmp_path, "--rl-steps", "1")
    bgpo.main(argv)
    run_dir = os.path.join(str(tmp_path), bgpo.parse_args(argv).run_name)
    assert os.path.basename(run_dir) == "arithmetic_bgpo_nt4_seed0"               # named in words
    with pytest.raises(bgpo.RunError, match="holds a run: --resume with its flags continues it, another"):
        bgpo.main(argv)
    with pytest.raises(bgpo.RunError, match=r"holds a run made with --eval-size 8 \(now 9\): --resume with"):
        bgpo.main(argv + ["--eval-size", "9"])
    described = json.load(open(os.path.join(run_dir, "run.json")))
    assert described["flags"]["rl_steps"] == 1 and described["torch"] == torch.__version__
    assert bgpo.main(argv + ["--overwrite"])[-1]["step"] == 1

def run_script(argv, monkeypatch, capsys):
    """bgpo.py run as a script (its __main__ block, in this process): its exit code and stderr."""
    monkeypatch.setattr(sys, "argv", ["bgpo.py", *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(bgpo.__file__, run_name="__main__")
    return e.value.code, capsys.readouterr().err

def test_a_finished_run_and_a_resume_with_other_flags_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    argv = tiny_argv(tmp_path, "--rl-steps", "1")
    bgpo.main(argv)
    for extra, message in [([], "holds a run: --resume with its flags continues it"),
                           (["--resume", "--mc-samples", "2", "--run-name", "arithmetic_bgpo_nt4_seed0"],
                            "made with --mc-samples 4 (now 2): --resume with its flags continues it")]:
        code, err = run_script(argv + extra, monkeypatch, capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert bgpo.main(argv[:-2] + ["--rl-steps", "2", "--resume"])[-1]["step"] == 2, "a longer run resumes"

@pytest.mark.parametrize("name", TASK_NAMES)
def test_each_task_runs_sft_then_rl_from_the_command_line(tmp_path, monkeypatch, capsys, name):
    argv = tiny_argv(tmp_path, "--task", name, "--sft-steps", "2", "--sft-eval-every", "2", "--rl-steps", "1")
    code, err = run_script(argv, monkeypatch, capsys)
    assert code == 0, err
    records = read_log(tmp_path / f"{name}_bgpo_nt4_seed0" / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1] and "accuracy" in records[1]
    assert len(list(tmp_path.glob(f"sft_{name}_*.pt"))) == 1, "the task's SFT checkpoint"

@pytest.mark.parametrize("objective", ["bgpo", "naive"])
def test_two_rl_steps_run_for_each_objective(tmp_path, objective):
    history = bgpo.main(tiny_argv(tmp_path, "--objective", objective))
    assert [h["step"] for h in history] == [0, 1, 2]
    run = tmp_path / bgpo.parse_args(tiny_argv(tmp_path, "--objective", objective)).run_name
    records = read_log(run / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and (run / "ckpt.pt").exists()
    assert records[0]["accuracy"] == history[0]["accuracy"], "step 0 is the SFT model's evaluation"
    for r in records[1:]:                                                 # what tells the run's health
        assert 0 <= r["mixed_groups"] <= 1 and 0 <= r["solved"] <= 1 and r["reward_std"] >= 0

SOLVE_MISS, MISSED, SOLVED = "solve, miss, ...", "all missed", "all solved"
NO_SOLVE_GROUP = "warning: no solve group (a solve and a miss: the solves RL reinforces) in the last "

@pytest.mark.parametrize("steps, eval_every, warnings", [
    ([SOLVE_MISS], 1, []),
    ([MISSED], 1, ["1 RL steps; 0% of this step's rollouts solve: more SFT (--sft-steps"]),
    ([SOLVED], 1, ["1 RL steps; 100% of this step's rollouts solve\n"]),
    ([MISSED, MISSED], 5, ["2 RL steps; 0%"]),                      # fewer RL steps than --eval-every
    ([SOLVE_MISS, MISSED, MISSED], 2, ["1 RL steps; 0%"])])         # the last evaluation off the beat
def test_an_rl_run_with_no_group_holding_a_solve_and_a_miss_says_so(tmp_path, monkeypatch, capsys, steps,
                                                                     eval_every, warnings):
    """Only a group with both a solve and a miss reinforces a solve. A run without one used to go on in
    silence (the SFT model of a plateau solved nothing); it now warns at each evaluation where no RL step
    since the one before had one, with the share of rollouts that solve, and what to do when it is small."""
    real, script = bgpo.sample_rollouts, iter(steps)

    def scripted_rollouts(model, task, prompts, args, generator):
        x, y, r = real(model, task, prompts, args, generator)
        return x, y, {SOLVE_MISS: torch.arange(len(r)) % 2, MISSED: torch.zeros(len(r)),
                      SOLVED: torch.ones(len(r))}[next(script)].double()

    monkeypatch.setattr(bgpo, "sample_rollouts", scripted_rollouts)
    bgpo.main(tiny_argv(tmp_path, "--rl-steps", str(len(steps)), "--eval-every", str(eval_every),
                        "--sft-steps", "2", "--sft-eval-every", "2"))
    out = capsys.readouterr().out
    records = read_log(tmp_path / "arithmetic_bgpo_nt4_seed0" / "log.jsonl")[1:]
    assert [r["solve_groups"] for r in records] == [float(s == SOLVE_MISS) for s in steps]
    assert out.count("warning:") == len(warnings), out[-600:]
    for warning in warnings:
        assert NO_SOLVE_GROUP + warning in out, out[-600:]

def test_one_on_policy_adamw_step_gives_the_same_parameters_for_bgpo_and_naive():
    model, x, y, mc, old_terms, A = on_policy_setup()
    new_params = {}
    for objective in ("bgpo", "naive"):
        m = tiny_model()
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        if objective == "bgpo":
            bgpo_backward(m, x, y, mc, None, A)
        else:
            naive_loss(m, x, y, mc, None, A).backward()
        optimizer.step()
        new_params[objective] = torch.cat([p.detach().flatten() for p in m.parameters()])
    moved = (new_params["bgpo"] - torch.cat([p.detach().flatten() for p in model.parameters()])).abs().max()
    assert moved > 1e-3, "the update should move the parameters"
    assert torch.allclose(new_params["bgpo"], new_params["naive"], rtol=0, atol=1e-9), (
        report(*new_params.values()))

def test_dropping_tied_groups_leaves_the_gradient_unchanged():
    """run_rl leaves out the rows with A = 0 and scales the others' A by their share of the rows: the same
    gradient as the whole batch."""
    model, x, y, mc, old_terms, A = on_policy_setup()                     # two of the six rows have A = 0
    bgpo_backward(model, x, y, mc, None, A)
    whole = grads(model)
    model.zero_grad()
    keep = (A != 0).nonzero()[:, 0]
    bgpo_backward(model, x[keep], y[keep], bgpo.MCSamples(mc.mask[keep], mc.weight[keep]), None,
                  A[keep] * (len(keep) / len(A)))
    assert torch.allclose(grads(model), whole, rtol=1e-10, atol=1e-14), report(grads(model), whole)

def test_updating_every_row_gives_the_update_that_leaves_the_tied_groups_out(tmp_path, monkeypatch):
    """--no-skip-tied (the GPU size's: a fixed shape) puts the rows with A = 0 in the update, where they add
    nothing: after two RL steps the weights are those of the default, which leaves them out and scales A."""
    real = bgpo.sample_rollouts
    one_solve = lambda *a: (*real(*a)[:2], (torch.arange(8) == 0).double())   # group 1 mixed, 2 tied
    monkeypatch.setattr(bgpo, "sample_rollouts", one_solve)
    weights, short_sft = {}, ["--sft-steps", "2", "--sft-eval-every", "2"]
    for flag in ("--skip-tied", "--no-skip-tied"):
        bgpo.main(tiny_argv(tmp_path, flag, f"--run-name={flag}", *short_sft))
        weights[flag] = torch.load(tmp_path / flag / "ckpt.pt", weights_only=True)["model"]
    sft_path = bgpo.sft_path(tiny_args(tmp_path, *short_sft))
    sft = bgpo.load_checkpoint(sft_path, get_task("arithmetic"))["model"]
    for name, w in weights["--skip-tied"].items():
        assert torch.allclose(w, weights["--no-skip-tied"][name], rtol=1e-9, atol=1e-12), name
    assert max((w - sft[name]).abs().max() for name, w in weights["--skip-tied"].items()) > 1e-5, "moved"

def test_with_two_minibatches_the_first_update_is_on_policy_and_the_second_is_not(tmp_path, monkeypatch):
    """--minibatches 2: the old policy's terms are computed once per rollout batch, on the shared MC
    draws. The first update, on the first half of the prompts, is the on-policy update of that half;
    it moves the policy, so the second update, on the other half, sees d_j != 0, and its gradient differs
    from the on-policy one (through the rows with A < 0: where A >= 0 the tangent line has no weight)."""
    real, seen = bgpo.bgpo_backward, []

    def check(model, x, y, mc, old_terms, A, clip_eps, mc_chunk):
        on_policy = copy.deepcopy(model)
        real(on_policy, x, y, mc, None, A)
        with torch.no_grad():
            d = (elbo_terms(model, x, y, mc) - old_terms) / y.shape[1]
        loss = real(model, x, y, mc, old_terms, A, clip_eps, mc_chunk)
        g, g_on = grads(model), grads(on_policy)
        seen.append((x.tolist(), ((g - g_on).norm() / g_on.norm()).item(), d.abs().max().item(), clip_eps))
        return loss

    monkeypatch.setattr(bgpo, "bgpo_backward", check)
    signs = lambda rewards, G: (-1.0) ** torch.arange(len(rewards)) * torch.linspace(0.5, 1, len(rewards))
    monkeypatch.setattr(bgpo, "group_advantages", signs)                  # both signs in each mini-batch
    real_rollouts, batches = bgpo.sample_rollouts, []
    monkeypatch.setattr(bgpo, "sample_rollouts", lambda *a: batches.append(real_rollouts(*a)) or batches[-1])
    bgpo.main(tiny_argv(tmp_path, "--sft-steps", "2", "--rl-steps", "1", "--minibatches", "2"))
    (x_1, rel_1, d_1, clip_1), (x_2, rel_2, d_2, clip_2) = seen           # B = 2 prompts x 4: 4 rows each
    assert x_1 == batches[0][0][:4].tolist() and x_2 == batches[0][0][4:].tolist()
    assert clip_1 == clip_2 == bgpo.CLIP_EPS
    assert d_1 < 1e-12 and rel_1 < 1e-10, (d_1, rel_1)
    assert d_2 > 1e-4 and rel_2 > 1e-6, (d_2, rel_2)

def test_demonstrations_are_a_fixed_set_of_training_problems(tmp_path):
    task = get_task("countdown")
    first = lambda *extra: next(bgpo.sft_batches(task, tiny_args(tmp_path, "--task", "countdown", *extra),
                                                 torch.Generator().manual_seed(0)))
    args = tiny_args(tmp_path, "--task", "countdown", "--demos", "40")
    prompts, answers = task.sample(40, "train", 10_000 + args.seed)
    assert all(task.reward(p, a) == 1.0 for p, a in zip(prompts, answers))
    known = {tuple(row) for row in torch.cat(bgpo.encode(task, prompts, answers), 1).tolist()}
    batches = bgpo.sft_batches(task, args, torch.Generator().manual_seed(0))
    seen = set()
    for _ in range(20):                                                   # SFT sees these 40 and nothing else
        seen |= {tuple(row) for row in torch.cat(next(batches), 1).tolist()}
    assert seen <= known and len(seen) == 40, len(seen)
    for p in prompts:  # the split is decided by the sorted numbers and the target
        numbers, target = p.split(":")
        assert tasks._split_of(",".join(map(str, sorted(map(int, numbers.split(","))))) + ":" + target,
                               task.test_percent, task.validation_percent) == "train", p
    # a later run (RL, the control, a resume) sees the same demonstrations; another seed other ones
    same = zip(first("--demos", "40"), first("--demos", "40", "--stage", "rl"))
    assert all(torch.equal(a, b) for a, b in same)
    assert not torch.equal(first("--demos", "40")[0], first("--demos", "40", "--seed", "1")[0])
    fresh = {tuple(row) for row in first("--demos", "0")[0].tolist()}     # 0: fresh problems each step
    assert len(fresh) > 0.9 * bgpo.SFT_BATCH and not fresh <= {k[:task.prompt_len] for k in known}

def test_sft_keeps_the_model_with_the_best_validation_reward_and_stops_after_patience(tmp_path, monkeypatch):
    task, real, snapshots = get_task("arithmetic"), bgpo.evaluate, []
    monkeypatch.setattr(bgpo, "SFT_PATIENCE", 2)
    monkeypatch.setitem(bgpo.SFT_MIN_STEPS, "arithmetic", 0)
    args = tiny_args(tmp_path, "--sft-steps", "100", "--sft-eval-every", "10")
    val_prompts, scripted = task.sample(args.val_size, "validation", 4321)[0], iter([0.2, 0.5, 0.4, 0.3, 0.9])

    def scripted_evaluate(model, task, prompts, args, n_show=3):
        result = real(model, task, prompts, args, n_show)
        if prompts == val_prompts:  # the validation score at steps 10, 20, ...
            result["reward"] = next(scripted)
            snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return result

    monkeypatch.setattr(bgpo, "evaluate", scripted_evaluate)
    model = bgpo.run_sft(args, task)
    saved = torch.load(bgpo.sft_path(args), weights_only=True)
    # best at step 20 (0.5); steps 30 and 40 are not better: patience 2 stops SFT at 40, before 0.9
    assert saved["step"] == 20 and [c["step"] for c in saved["curve"]] == [10, 20, 30, 40]
    assert [c["val_reward"] for c in saved["curve"]] == [0.2, 0.5, 0.4, 0.3]
    for name, value in model.state_dict().items():
        assert torch.equal(value, snapshots[1][name]) and torch.equal(saved["model"][name], value), name
    assert any(not torch.equal(snapshots[3][n], v) for n, v in snapshots[1].items()), (
        "SFT went on after step 20")

def test_sft_does_not_stop_on_a_plateau_before_the_tasks_minimum_steps(tmp_path, monkeypatch, capsys):
    """A flat start then a rise, as arithmetic's validation reward does for its first 300-500 steps: patience
    alone would keep the plateau's model; SFT_MIN_STEPS keeps training until the rise."""
    task, real = get_task("arithmetic"), bgpo.evaluate
    monkeypatch.setattr(bgpo, "SFT_PATIENCE", 2)
    args = tiny_args(tmp_path, "--sft-steps", "100", "--sft-eval-every", "10")
    val_prompts = task.sample(args.val_size, "validation", 4321)[0]

    def run(min_steps):
        scripted = iter([0.02, 0.0, 0.01, 0.0, 0.0, 0.3, 0.5, 0.4, 0.45, 0.2])
        def scripted_evaluate(model, task, prompts, args, n_show=3):
            result = real(model, task, prompts, args, n_show)
            result["reward"] = next(scripted) if prompts == val_prompts else result["reward"]
            return result
        monkeypatch.setattr(bgpo, "evaluate", scripted_evaluate)
        monkeypatch.setitem(bgpo.SFT_MIN_STEPS, "arithmetic", min_steps)
        bgpo.run_sft(args, task)
        saved = torch.load(bgpo.sft_path(args), weights_only=True)
        return saved["step"], saved["curve"][-1]["step"]

    assert run(0) == (10, 30), "patience alone stops on the plateau, keeping step 10"
    assert run(60) == (70, 90), "with a minimum of 60 steps SFT sees the rise and keeps step 70"
    assert "m60_" in bgpo.sft_path(args), "the minimum is in the SFT checkpoint's name"

def test_resume_gives_the_same_result_as_an_uninterrupted_run(tmp_path):
    argv = tiny_argv(tmp_path)
    bgpo.main(argv + ["--rl-steps", "4", "--run-name", "straight"])
    bgpo.main(argv + ["--rl-steps", "2", "--run-name", "interrupted"])
    with open(tmp_path / "interrupted" / "log.jsonl", "a") as f:          # a line after the checkpoint
        f.write(json.dumps({"step": 3, "reward": -1.0}) + "\n")
    bgpo.main(argv + ["--rl-steps", "4", "--run-name", "interrupted", "--resume", "--stage", "rl"])
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "interrupted" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 4
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    logs = [read_log(tmp_path / run / "log.jsonl") for run in ("straight", "interrupted")]
    assert [r["step"] for r in logs[1]] == [0, 1, 2, 3, 4]                # step 0 (the SFT model), then 1-4
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in logs[0]] == \
           [{k: v for k, v in r.items() if k != "seconds"} for r in logs[1]]

@pytest.mark.parametrize("streams", ["one tensor, as the code before the GPU path saved them",
                                     "a GPU generator's 16 bytes, as a run on CUDA saves them"])
def test_a_resume_from_random_streams_of_another_device_or_older_code_exits_2(tmp_path, streams):
    """The checkpoint holds each process's [generator state, noise state]; the noise generator is the CPU one
    on the CPU and a GPU one on CUDA. A state this run cannot take is a RunError (one line, exit code 2), not
    a traceback from inside Generator.set_state."""
    argv = tiny_argv(tmp_path, "--rl-steps", "1")
    bgpo.main(argv)
    path = tmp_path / bgpo.parse_args(argv).run_name / "ckpt.pt"
    state = torch.load(path, weights_only=True)
    generator_state = state["rng"][0][0]
    gpu_state = torch.zeros(16, dtype=torch.uint8)
    state["rng"] = [generator_state] if streams.startswith("one") else [[generator_state, gpu_state]]
    torch.save(state, path)
    with pytest.raises(bgpo.RunError, match="holds the random streams of another device or an older bgpo.py"):
        bgpo.main(tiny_argv(tmp_path, "--rl-steps", "2", "--resume", "--stage", "rl"))

def test_the_trained_model_answers_a_users_prompt(tmp_path, capsys):
    bgpo.main(tiny_argv(tmp_path, "--rl-steps", "1"))
    capsys.readouterr()
    answer = bgpo.main(tiny_argv(tmp_path, "--rl-steps", "1", "--prompt", "12+30="))
    out = capsys.readouterr().out
    ckpt = str(tmp_path / bgpo.parse_args(tiny_argv(tmp_path, "--rl-steps", "1")).run_name / "ckpt.pt")
    assert f"12+30= -> {answer} -> reward " in out and ckpt in out and "how the sampler writes 12+30=" in out
    reward = float(out.split(f"12+30= -> {answer} -> reward ")[1].split()[0])
    assert reward == get_task("arithmetic").reward("12+30=", answer)

@pytest.mark.parametrize("extra, message", [
    (["--task", "chess"], "invalid choice: 'chess'"),
    (["--sft-steps", "0"], "--sft-steps must be at least 1"),
    (["--objective", "naive", "--mc-chunk", "2"], "--mc-chunk is an option of --objective bgpo"),
    (["--objective", "stp"], "invalid choice"),
    (["--group-size", "1"], "at least 2"),
    (["--resume", "--run-name", "nothing-here"], "no run to resume"),
    (["--resume", "--overwrite"], "--resume continues an RL run: use it with --stage rl or all, without"),
    (["--device", "tpu"], "not available here"),
    (["--device", "cuda:x"], "not available here"),
    (["--demos", "-1"], "--demos must be at least 0"),
    (["--val-size", "x"], "invalid int value"),
    (["--stage", "control"], "invalid choice"),
    (["--minibatches", "0"], "--minibatches must be at least 1"),
    (["--minibatches", "3"], "--minibatches 3 must divide --prompts-per-step 2"),
    (["--n-embd", "15"], "--n-head 2 must divide --n-embd 15"),
    (["--prompt", "12+ab="], "--prompt '12+ab=': not a arithmetic problem"),
    (["--prompt", "15,4,1:64"], "not a arithmetic problem like"),
    (["--prompt", "\u0663\u0661+4="], "not a arithmetic problem like"),               # Arabic-Indic digits
    (["--task", "countdown", "--prompt", "\u0663,4,1:64"], "not a countdown problem like"),
    (["--task", "countdown", "--prompt", "\uff11\uff15,4,1:64"], "not a countdown problem"),  # full width
    (["--size", "tpu"], "invalid choice: 'tpu'"),
    (["--dtype", "float16"], "invalid choice: 'float16'"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        tiny_args(tmp_path, *extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err

def test_the_gpu_size_sets_its_flags_defaults_and_a_flag_given_wins():
    """--size gpu changes the defaults of the flags it names, and only those; a flag on the command line
    wins over the size. The CPU size is the defaults as --help lists them, float32 on the CPU."""
    cpu, gpu = bgpo.parse_args(["--device", "cpu"]), bgpo.parse_args(["--device", "cpu", "--size", "gpu"])
    cpu_size = bgpo.parse_args(["--device", "cpu", "--size", "cpu"])
    assert vars(cpu) == {**vars(cpu_size), "size_auto": cpu_size_why()}
    assert cpu.dtype == "float32" and (cpu.n_layer, cpu.n_embd, cpu.rl_steps, cpu.demos) == (3, 128, 200, 500)
    changed = {name for name in vars(cpu) if getattr(cpu, name) != getattr(gpu, name)}
    assert changed == set(bgpo.SIZES["gpu"]) | {"size", "size_auto", "run_name"}, changed
    assert gpu.run_name == cpu.run_name + "_gpu"   # a run of each size in its own folder
    assert all(getattr(gpu, name) == value for name, value in bgpo.SIZES["gpu"].items())
    mine = bgpo.parse_args(["--device", "cpu", "--size", "gpu", "--rl-steps", "7", "--n-layer", "2"])
    assert (mine.rl_steps, mine.n_layer, mine.n_embd) == (7, 2, bgpo.SIZES["gpu"]["n_embd"])

CARDS = {"RTX 4090": (24, 8, 9), "A100 80GB": (80, 8, 0), "RTX 2070": (8, 7, 5), "T4": (15, 7, 5),
         "Quadro K620": (2, 5, 0)}   # GB of memory, compute capability

@pytest.mark.parametrize("card, dtype, chunk", [("RTX 4090", "bfloat16", 8), ("A100 80GB", "bfloat16", 8),
                                               ("RTX 2070", "float32", 2), ("T4", "float32", 4),
                                               ("Quadro K620", "float32", None)])
def test_size_auto_fits_the_card(monkeypatch, capsys, card, dtype, chunk):
    """--size auto (the default) on CUDA takes the GPU size's defaults with the most masked copies a backward
    (8, 4, 2 or 1, at every size) whose activations, COPY_GIB each, fit in half the card's memory, or the CPU
    size's where even one does not. By hand: 8 GB (7.45 GiB) in float32 has 3.73 GiB for 2 x 1.06, not 4
    (4.24); a T4's 15 GB (13.97 GiB) 6.98 for 4; 2 GB 0.93, not one. bf16 from compute capability 8.0. The
    card is faked (its properties, and the device)."""
    gb, major, minor = CARDS[card]
    memory = gb * 10**9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    properties = SimpleNamespace(name=f"NVIDIA {card}", total_memory=memory, major=major, minor=minor)
    monkeypatch.setattr(bgpo, "pick_device", lambda p, device: ("cpu", []) if device == "cpu" else
                        ("cuda", [properties]))
    args = bgpo.parse_args([])
    assert (args.size, args.dtype, args.mc_chunk) == ("gpu" if chunk else "cpu", dtype, chunk or 1)
    assert args.size_auto == f" (--size auto: NVIDIA {card}, {memory / 2**30:.0f} GiB, {dtype}: " \
        + (f"--mc-chunk {chunk})" if chunk else "too small a card)")
    size = bgpo.SIZES[args.size]
    assert all(getattr(args, name) == value for name, value in size.items() if name != "mc_chunk")
    given = bgpo.parse_args(["--mc-chunk", "1", "--n-layer", "2", "--dtype", "float32"])   # the flags win
    assert (given.mc_chunk, given.n_layer, given.dtype) == (1, 2, "float32")
    assert bgpo.parse_args(["--objective", "naive"]).mc_chunk == 1   # no chunks: one graph
    explicit = bgpo.parse_args(["--size", "gpu"])   # --size gpu: that size, with the card's --mc-chunk
    assert (explicit.size, explicit.mc_chunk, explicit.size_auto) == ("gpu", chunk or 1, "")
    told = bgpo.parse_args(["--device", "cpu"])   # a CUDA machine, told --device cpu
    assert (told.size, told.dtype, told.size_auto) == ("cpu", "float32", " (--size auto: --device cpu)")
    with pytest.raises(SystemExit):   # --help lists the defaults this card gets, not the CPU size's
        bgpo.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"(default: {dtype})" in shown and f"(default: {chunk or 1})" in shown, shown
    assert f"transformer blocks (default: {args.n_layer})" in shown, shown

# torch.cuda.get_arch_list() of PyPI's torch 2.14.1+cu130 (x86-64): the capabilities it has kernels for
CUDA_13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]

def fake_cards(setattr, *cards, archs=CUDA_13_ARCHS):
    """This process's torch.cuda sees `cards`, (name, major, minor, GiB) each, and a build with kernels for
    `archs`; its tensors on "cuda" still fail (what lab/simulated_cuda does to every process of a command)."""
    properties = [SimpleNamespace(name=name, major=major, minor=minor, total_memory=gib * 2**30)
                  for name, major, minor, gib in cards]
    setattr(torch.cuda, "is_available", lambda: True)
    setattr(torch.cuda, "device_count", lambda: len(cards))
    setattr(torch.cuda, "get_device_properties", lambda i: properties[torch.device(i).index or 0
                                                                      if isinstance(i, str) else i])
    setattr(torch.cuda, "get_arch_list", lambda: archs)

@pytest.mark.parametrize("name, major, minor, kernels", [
    ("NVIDIA GeForce GTX 1080", 6, 1, False), ("Tesla V100-SXM2-16GB", 7, 0, False),
    ("Tesla T4", 7, 5, True), ("NVIDIA GeForce RTX 5090", 12, 0, True)])
def test_a_card_the_build_has_no_kernels_for_exits_2_with_one_line_before_sft(tmp_path, monkeypatch, capsys,
                                                                                name, major, minor, kernels):
    """PyPI's CUDA 13 wheel has kernels for compute capability 7.5 on (sm_75 ... sm_120; a kernel for X.Y runs
    on X.Y to X.9). On an older card PyTorch only warns and torch.empty(0, device="cuda") passes, so the run
    would announce the GPU size and fail at SFT's first kernel. It ends at once with one line naming the card
    and the build to install; a card the wheel covers passes (and fails here only as no card computes)."""
    fake_cards(monkeypatch.setattr, (name, major, minor, 8))
    code, err = run_script(tiny_argv(tmp_path, "--device", "cuda"), monkeypatch, capsys)
    too_old = (f"bgpo.py: error: the {name} (compute capability {major}.{minor}) has no kernels in this "
               "PyTorch; its CUDA 12.6 build has: pip install torch -i "
               "https://download.pytorch.org/whl/cu126\n")
    assert (code, err) == (2, "bgpo.py: error: --device cuda is not available here\n" if kernels else too_old)
    fake_cards(monkeypatch.setattr, (name, major, minor, 8), archs=[])   # a build that names no kernels
    assert run_script(tiny_argv(tmp_path, "--device", "cuda"), monkeypatch, capsys)[1].endswith("here\n")

def test_size_auto_is_the_cpu_size_without_cuda(monkeypatch):
    """Without CUDA (the CPU, Apple's MPS) --size auto is the CPU size, in float32, and says why; an explicit
    --size gpu is the GPU size there too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cpu", "mps"):
        monkeypatch.setattr(bgpo, "pick_device", lambda p, given: (device, []))
        args = bgpo.parse_args([])
        assert (args.size, args.dtype, args.n_layer, args.size_auto) == ("cpu", "float32", 3,
                                                                       " (--size auto: no CUDA device)")
        explicit = bgpo.parse_args(["--size", "gpu"])
        assert all(getattr(explicit, name) == value for name, value in bgpo.SIZES["gpu"].items())

@pytest.mark.parametrize("at_step, after", [(1, "--overwrite"), (3, "--resume")])
def test_out_of_gpu_memory_names_remedies_that_each_work_from_where_it_stopped(tmp_path, monkeypatch, capsys,
                                                                               at_step, after):
    """A torch.OutOfMemoryError (simulated on the CPU in an RL step's rollouts) at the GPU size ends the run
    with one line and exit code 2. Before the first checkpoint (step 2 here) it names --overwrite, after it
    --resume, each with half the --mc-chunk; then --size cpu. Each remedy, run as printed, finishes a run."""
    argv = tiny_argv(tmp_path, "--size", "gpu", "--mc-chunk", "8", "--rl-steps", "3", "--eval-every", "2",
                     "--sft-steps", "2", "--sft-eval-every", "2", "--stage", "all")   # a card's --mc-chunk 8
    real, rollouts = tiny_dllm.generate, []

    def out_of_memory(*args, **kwargs):
        rollouts.append(kwargs.get("temperature", 0) > 0)   # the evaluations are greedy
        if sum(rollouts) == at_step and rollouts[-1]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_dllm, "generate", out_of_memory)   # what bgpo.py imports as a script
    code, err = run_script(argv, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{after} --mc-chunk 4 uses less memory, or --size cpu runs the CPU size" in err, err
    monkeypatch.setattr(tiny_dllm, "generate", real)
    run = tmp_path / "arithmetic_bgpo_nt4_seed0_gpu"
    cpu_size = run.with_name("arithmetic_bgpo_nt4_seed0")
    for remedy, folder in (([after, "--mc-chunk", "4"], run), (["--size", "cpu"], cpu_size)):
        monkeypatch.setattr(sys, "argv", ["bgpo.py", *argv, *remedy])
        with pytest.raises(SystemExit) as e:
            runpy.run_path(bgpo.__file__, run_name="__main__")
        assert e.value.code == 0 and torch.load(folder / "ckpt.pt", weights_only=True)["step"] == 3, remedy

# what each GPU raises when its memory runs out: CUDA a torch.OutOfMemoryError; Apple's MPS a plain
# RuntimeError (aten/src/ATen/mps/MPSAllocator.mm, MPSHeapAllocatorImpl::alloc_buffer_block:
# TORCH_CHECK(false, "MPS backend out of memory (MPS allocated: ...")
OUT_OF_MEMORY = {"CUDA": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                 "MPS": lambda: RuntimeError("MPS backend out of memory (MPS allocated: 17.60 GiB, other "
                                             "allocations: 1.02 GiB, max allowed: 18.13 GiB). Tried to "
                                             "allocate 512.00 MiB on private pool.")}

@pytest.mark.parametrize("gpu", OUT_OF_MEMORY)
def test_out_of_gpu_memory_at_the_cpu_size_names_the_cpu(tmp_path, monkeypatch, capsys, gpu):
    """At the CPU size with --mc-chunk 1 (a small card's, and a Mac's) the out-of-memory line has no smaller
    size or chunk to name: it names the CPU device (simulated on the CPU, in RL step 1's rollouts)."""
    real = tiny_dllm.generate

    def out_of_memory(*args, **kwargs):
        if kwargs.get("temperature", 0) > 0:
            raise OUT_OF_MEMORY[gpu]()
        return real(*args, **kwargs)
    monkeypatch.setattr(tiny_dllm, "generate", out_of_memory)   # what bgpo.py imports as a script
    code, err = run_script(tiny_argv(tmp_path, "--size", "cpu", "--sft-steps", "2", "--sft-eval-every", "2"),
                           monkeypatch, capsys)
    assert (code, err) == (2, "bgpo.py: error: out of GPU memory: --device cpu runs it on the CPU\n"), err

@pytest.mark.parametrize("gpu", OUT_OF_MEMORY)
def test_out_of_gpu_memory_in_sft_ends_the_script_with_one_line_and_exit_2(tmp_path, monkeypatch, capsys,
                                                                            gpu):
    """Out of memory outside RL's steps (here SFT's first step, simulated on the CPU): one line naming the CPU
    size and the CPU (a run at the CPU size needs the second), exit code 2, no traceback. Any other
    RuntimeError still ends in its traceback."""
    def out_of_memory(*args, **kwargs):
        raise OUT_OF_MEMORY[gpu]()
    monkeypatch.setattr(tiny_dllm, "sft_loss", out_of_memory)   # what bgpo.py imports as a script
    code, err = run_script(tiny_argv(tmp_path), monkeypatch, capsys)
    assert (code, err) == (2, "bgpo.py: error: out of GPU memory: --size cpu, or --device cpu\n"), err
    monkeypatch.setattr(tiny_dllm, "sft_loss", lambda *a, **k: torch.ones(2, 3) @ torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        run_script(tiny_argv(tmp_path), monkeypatch, capsys)

@pytest.mark.parametrize("gpu", OUT_OF_MEMORY)
def test_the_memory_table_goes_on_past_an_update_that_runs_out_of_memory(tmp_path, monkeypatch, capsys, gpu):
    """bgpo.py --bench-memory: BGPO's activation memory stays flat while the naive objective's grows, and a
    row whose naive update raises torch.OutOfMemoryError says so while BGPO's row and the later rows go on."""
    naive_loss = bgpo.naive_loss

    def out_of_memory_from_16(model, x, y, mc, *rest):
        if mc.weight.shape[1] >= 16:
            raise OUT_OF_MEMORY[gpu]()
        return naive_loss(model, x, y, mc, *rest)

    monkeypatch.setattr(bgpo, "naive_loss", out_of_memory_from_16)
    rows = bgpo.main(tiny_argv(tmp_path, "--bench-memory"))
    out = capsys.readouterr().out
    assert [row["n_t"] for row in rows] == [1, 2, 4, 8, 16, 32, 64]
    assert [row["naive"] is None for row in rows] == [False] * 4 + [True] * 3
    assert rows[-1]["bgpo"]["mb"] <= 1.1 * rows[0]["bgpo"]["mb"], "BGPO: one sample's graph at a time"
    assert rows[3]["naive"]["mb"] > 6 * rows[0]["naive"]["mb"], "naive: n_t graphs at once"
    assert out.count("nan | naive: out of memory") == 3 and rows[0]["naive"]["cuda_mb"] is None

def test_a_missing_checkpoint_exits_2_with_one_line_from_the_command_line(tmp_path, capsys, monkeypatch):
    argv = ["--prompt", "15,4,1:64", "--out-dir", str(tmp_path), "--device", "cpu"]
    code, err = run_script(argv, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "no checkpoint at" in err, err

def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    real, updates = bgpo.bgpo_backward, []

    def nan_from_second_step(*args):
        updates.append(1)
        return real(*args) if len(updates) == 1 else float("nan")

    monkeypatch.setattr(bgpo, "bgpo_backward", nan_from_second_step)
    # never all tied
    monkeypatch.setattr(bgpo, "group_advantages", lambda rewards, G: torch.ones(len(rewards)))
    with pytest.raises(bgpo.RunError, match="at RL step 2.*step 1"):
        bgpo.main(tiny_argv(tmp_path, "--rl-steps", "3"))
    kept = torch.load(tmp_path / bgpo.parse_args(tiny_argv(tmp_path, "--rl-steps", "3")).run_name / "ckpt.pt",
                      weights_only=True)
    assert kept["step"] == 1

# Data parallel: two gloo processes on the CPU against one process, on the same batch ------------------------

DP_ARGV = ["--task", "arithmetic", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--device", "cpu",
           "--prompts-per-step", "8", "--group-size", "2", "--mc-samples", "8", "--rl-steps", "1",
           "--eval-size", "3", "--val-size", "3", "--sft-steps", "2", "--sft-eval-every", "2"]
DP_CASES = [("bgpo", 1), ("naive", 1), ("bgpo", 2), ("naive", 2), ("bgpo", 4)]
# groups 2 and 3 tie: with --minibatches 2, process 1's first mini-batch is those two, without a gradient;
# with --minibatches 4, the second mini-batch is those two on both processes: no step at all
DP_REWARDS = [1, 0, .5, 0, 0, 0, 1, 1, 0, 1, .2, .1, 1, 0, 0, .5]
DP_STEPS = {1: 1, 2: 2, 4: 3}   # optimizer steps of one RL step, by --minibatches
CLIP_GRAD_NORM = torch.nn.utils.clip_grad_norm_

def dp_rows(args, n_rows, minibatches):
    """The rows of a batch of n_rows (whole groups) that process args.rank of args.world holds. run_rl
    splits them into mini-batches in order; one process's k-th mini-batch is the union of every process's
    k-th, so that the one-process run makes the same updates."""
    per = n_rows // (minibatches * args.world)   # rows per process per mini-batch
    return torch.tensor([k * per * args.world + args.rank * per + i for k in range(minibatches)
                         for i in range(per)])

def record_grads(setattr):
    """The gradient of every optimizer step, as the update leaves it, before clipping."""
    seen = []

    def recording_clip(params, *args, **kwargs):
        params = list(params)
        seen.append(torch.cat([p.grad.flatten() for p in params]))
        return CLIP_GRAD_NORM(params, *args, **kwargs)

    setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    return seen

def seeded_model(task, args):
    torch.manual_seed(0)
    return bgpo.make_model(task, args)

def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])

def dp_rl_update(argv, setattr):
    """One RL step of run_rl on a fixed rollout batch and MC draws (rollouts and draws replaced, the rest
    run_rl's own), by this process's share of the batch: the parameters, gradients and log it leaves."""
    args, task = bgpo.parse_args(argv), get_task("arithmetic")
    B = args.prompts_per_step * args.group_size
    x, y = bgpo.encode(task, *task.sample(B, "train", 0))
    rewards = torch.tensor(DP_REWARDS)
    mc = draw_mc_samples(B, task.gen_len, args.mc_samples, torch.Generator().manual_seed(1))
    rows = dp_rows(args, B, args.minibatches)
    setattr(bgpo, "sample_rollouts", lambda *_: (x[rows], y[rows], rewards[rows]))
    setattr(bgpo, "draw_mc_samples", lambda *_: bgpo.MCSamples(mc.mask[rows], mc.weight[rows]))
    grads_seen, model = record_grads(setattr), seeded_model(task, args)
    initial = flat_params(model)
    bgpo.run_rl(args, task, model)
    log = os.path.join(args.out_dir, args.run_name, "log.jsonl")
    return {"initial": initial, "params": flat_params(model), "grads": grads_seen,
            "log": read_log(log) if args.rank == 0 else None}

def dp_sft_steps(argv, setattr):
    """Two steps of run_sft on a fixed batch of 8 demonstrations with fixed masks, by this process's share."""
    args, task = bgpo.parse_args(argv), get_task("arithmetic")
    x, y = bgpo.encode(task, *task.sample(8, "train", 0))
    mask, weight = forward_process(8, task.gen_len, 1, torch.Generator().manual_seed(1))
    rows = torch.arange(8).chunk(args.world)[args.rank]
    setattr(bgpo, "sft_batches", lambda *_: itertools.repeat((x[rows], y[rows])))
    setattr(tiny_dllm, "forward_process", lambda *_: (mask[rows], weight[rows]))
    grads_seen = record_grads(setattr)
    torch.manual_seed(args.seed)
    initial = flat_params(bgpo.make_model(task, args))   # run_sft's first weights
    return {"initial": initial, "params": flat_params(bgpo.run_sft(args, task)), "grads": grads_seen}

def scripted_task():
    """Arithmetic with a verifier that scores any text (a random model solves nothing): 0, 0.5 or 1."""
    task = get_task("arithmetic")
    task.reward = lambda prompt, completion: [0.0, 0.5, 1.0][sum(map(ord, prompt + completion)) % 3]
    return task

def dp_evaluate(argv, setattr):
    """evaluate on 11 problems: the rows this process decodes, and the accuracy and mean reward it gets."""
    args, task, decoded, generate = bgpo.parse_args(argv), scripted_task(), [], bgpo.generate
    setattr(bgpo, "generate", lambda model, x, *a, **k: decoded.append(len(x)) or generate(model, x, *a, **k))
    result = bgpo.evaluate(seeded_model(task, args), task, task.sample(11, "test", 0)[0], args)
    return sum(decoded), result["accuracy"], result["reward"]

def dp_first_batches(argv, setattr):
    """The first SFT batch and the first RL prompts this process draws (run_sft's and run_rl's own draws)."""
    args, task, seen = bgpo.parse_args(argv + ["--sft-steps", "1"]), scripted_task(), {}
    sft_loss, sample_rollouts = bgpo.sft_loss, bgpo.sample_rollouts

    def watched_sft_loss(model, x, y, **kwargs):
        seen.setdefault("sft", x)
        return sft_loss(model, x, y, **kwargs)

    def watched_sample_rollouts(model, task, prompts, *args):
        seen.setdefault("rl", prompts)
        return sample_rollouts(model, task, prompts, *args)

    setattr(bgpo, "sft_loss", watched_sft_loss)
    setattr(bgpo, "sample_rollouts", watched_sample_rollouts)
    bgpo.run_rl(args, task, bgpo.run_sft(args, task))
    return seen

def dp_resume(out_dir):
    """Two RL steps in one go, and one step then --resume for the second: the parameters after each."""
    params, task = {}, scripted_task()
    for run, steps in (("straight", ["2"]), ("resumed", ["1", "2"])):
        for i, rl_steps in enumerate(steps):
            args = bgpo.parse_args(DP_ARGV + ["--rl-steps", rl_steps, "--eval-every", "1", "--run-name", run,
                                              "--out-dir", out_dir] + ["--resume"] * i)
            model = seeded_model(task, args)
            bgpo.run_rl(args, task, model)
            if dist.is_initialized():
                dist.barrier()   # rank 0's checkpoint is written before any process resumes from it
        params[run] = flat_params(model)
    params["initial"] = flat_params(seeded_model(task, args))
    return params

def dp_syncs_of_one_bgpo_update(rank, sizes):
    """The sizes of the gradient all-reduces in one BGPO update at n_t = 8 of the default model, on this
    process's 2 rows: bgpo.py's (bgpo_backward, then average_gradients), and DDP's, which syncs at every
    backward unless told no_sync (each bucket of the gradient once per backward)."""
    args, task = bgpo.parse_args(["--device", "cpu"]), get_task("countdown")
    x, y = bgpo.encode(task, *task.sample(2, "train", rank))
    mc = draw_mc_samples(2, task.gen_len, 8, torch.Generator().manual_seed(rank))
    A = torch.tensor([1.0, -1.0])
    model, ddp_syncs = seeded_model(task, args), []
    sizes.clear()
    bgpo.average_gradients(model, args, bgpo_backward(model, x, y, mc, None, A), 2)
    ours = list(sizes)
    ddp = torch.nn.parallel.DistributedDataParallel(seeded_model(task, args))
    ddp.config = ddp.module.config   # what masked_log_likelihood reads
    ddp.register_comm_hook(None, lambda state, bucket: ddp_syncs.append(bucket.buffer().numel()) or
                           default_hooks.allreduce_hook(None, bucket))
    bgpo_backward(ddp, x, y, mc, None, A)
    return {"n_params": model.num_params(), "bgpo.py": ours, "DDP": ddp_syncs}

def dp_decision_on_mixed_cards(rank, patch):
    """What parse_args decides in this process of two, on a machine with an RTX 4090 and an RTX 2080 Ti
    (faked: torch.cuda's answers, and tensors on "cuda" made on the CPU), as torchrun starts it."""
    fake_cards(patch.setattr, ("NVIDIA GeForce RTX 4090", 8, 9, 24), ("NVIDIA GeForce RTX 2080 Ti", 7, 5, 11))
    empty = torch.empty
    patch.setattr(torch, "empty", lambda *size, device=None, **kwargs: empty(*size, **kwargs))
    patch.setenv("LOCAL_RANK", str(rank))
    patch.setenv("LOCAL_WORLD_SIZE", "2")
    args = bgpo.parse_args(DP_ARGV[:DP_ARGV.index("--device")] + DP_ARGV[DP_ARGV.index("--device") + 2:])
    return {"device": args.device, "size": args.size, "dtype": args.dtype, "mc_chunk": args.mc_chunk,
            "first line": args.size_auto, "sft file": bgpo.sft_path(args)}

def dp_stats(patch):
    """average_gradients' means of a 0-dim tensor (SFT's loss) and of numbers (RL's loss and row count), each
    process giving its own; the tensor's without .item() or .tolist(), which on a GPU wait for it."""
    args, model = bgpo.parse_args(DP_ARGV), seeded_model(get_task("arithmetic"), bgpo.parse_args(DP_ARGV))
    rank = args.rank
    with pytest.MonkeyPatch.context() as no_wait:
        for method in ("item", "tolist"):
            no_wait.setattr(torch.Tensor, method, lambda self: pytest.fail(f".{method}() waits for the GPU"))
        [loss] = bgpo.average_gradients(model, args, torch.tensor(1.0 + 2 * rank))
    return {"tensor": loss, "numbers": bgpo.average_gradients(model, args, 1.0 + 2 * rank, 3 * rank)}

def dp_worker(rank, port, out_dir):
    """One of two processes, as torchrun starts them (the environment), with gloo on the CPU. Each part runs
    with its own patches (undone after it); sizes records the number of elements of every all_reduce."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_default_dtype(torch.float64)
    bgpo.SFT_BATCH = TINY_SFT_BATCH   # as the small_sft_batches fixture sets it in the process that compares
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))   # a hang fails the test
    sizes, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: sizes.append(tensor.numel()) or all_reduce(tensor, *a, **k)
    results = {"resume": dp_resume(f"{out_dir}/resume")}
    parts = {"evaluate": lambda setattr: dp_evaluate(DP_ARGV, setattr),
             "first batches": lambda setattr: dp_first_batches(DP_ARGV + ["--out-dir", out_dir], setattr),
             "sft": lambda setattr: dp_sft_steps(DP_ARGV + ["--out-dir", f"{out_dir}/sft"], setattr),
             "syncs": lambda setattr: dp_syncs_of_one_bgpo_update(rank, sizes)}
    cards = {"cards": lambda patch: dp_decision_on_mixed_cards(rank, patch), "stats": dp_stats}
    for objective, k in DP_CASES:
        argv = DP_ARGV + ["--objective", objective, "--minibatches", str(k), "--out-dir", f"{out_dir}/{k}"]
        parts[objective, k] = lambda setattr, argv=argv: {**dp_rl_update(argv, setattr),
                                                          "all_reduce_sizes": list(sizes)}
    for name, part in parts.items():
        with pytest.MonkeyPatch.context() as patch:
            sizes.clear()
            results[name] = part(patch.setattr)
    for name, part in cards.items():   # parts that patch the environment too
        with pytest.MonkeyPatch.context() as patch:
            results[name] = part(patch)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()

# Not fork: a process forked after autograd has run on CUDA cannot run autograd ("Unable to handle autograd's
# threading in combination with fork-based multiprocessing"), and on a GPU machine the tests before these ran
# it. A forkserver is a fresh process that imports this module once; each child is forked from it.
START_METHOD = "forkserver"

def processes_context():
    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload([__name__])
    return context

@pytest.fixture(scope="module", autouse=True)
def forkserver_started_early():
    """The forkserver starts with this module's first test, and imports this module while the tests before the
    data-parallel ones run (it forks their processes later, when they ask)."""
    processes_context()
    multiprocessing.forkserver.ensure_running()

def free_port():
    """A TCP port nobody listens on now: the rendezvous address of two processes of a test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """What each of the two processes returned (a list by rank)."""
    out_dir, port = tmp_path_factory.mktemp("dp"), free_port()
    processes_context()
    torch.multiprocessing.start_processes(dp_worker, args=(port, str(out_dir)), nprocs=2,
                                          start_method=START_METHOD)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]

def relative_difference(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()

@pytest.mark.parametrize("objective, minibatches", DP_CASES)
def test_data_parallel_rl_update_equals_one_process_on_the_whole_batch(two_processes, tmp_path, monkeypatch,
                                                                        objective, minibatches):
    """Two processes, each with half the groups (of every mini-batch), end one RL step with the parameters
    that one process updating on the whole batch ends with, and each optimizer step saw the same gradient
    (the gradient itself: Adam's step barely changes when the gradient is scaled). The log, written by
    rank 0, is over both processes' rollouts."""
    argv = DP_ARGV + ["--objective", objective, "--minibatches", str(minibatches), "--out-dir", str(tmp_path)]
    one = dp_rl_update(argv, monkeypatch.setattr)
    assert len(one["grads"]) == DP_STEPS[minibatches]
    for rank, result in enumerate(r[objective, minibatches] for r in two_processes):
        assert relative_difference(result["params"], one["params"]) <= 1e-10, rank
        for step, (g_dp, g_one) in enumerate(zip(result["grads"], one["grads"], strict=True)):
            assert relative_difference(g_dp, g_one) <= 1e-10, (rank, step, report(g_dp, g_one))
    assert relative_difference(one["params"], one["initial"]) > 1e-6, "the update should move the parameters"
    log = two_processes[0][objective, minibatches]["log"]
    for key in ("reward", "reward_std", "mixed_groups", "solved", "loss", "accuracy"):
        assert log[1][key] == pytest.approx(one["log"][1][key], rel=1e-10, abs=1e-12), key

def test_data_parallel_sft_steps_equal_one_process_on_the_whole_batch(two_processes, tmp_path, monkeypatch):
    """Two SFT steps, each process with half of every batch, against one process with the whole batch."""
    one = dp_sft_steps(DP_ARGV + ["--out-dir", str(tmp_path)], monkeypatch.setattr)
    assert len(one["grads"]) == 2 and relative_difference(one["params"], one["initial"]) > 1e-6
    for rank, result in enumerate(r["sft"] for r in two_processes):
        assert relative_difference(result["params"], one["params"]) <= 1e-10, rank
        for step, (g_dp, g_one) in enumerate(zip(result["grads"], one["grads"], strict=True)):
            assert relative_difference(g_dp, g_one) <= 1e-10, (rank, step, report(g_dp, g_one))

def test_bgpo_syncs_gradients_once_per_optimizer_step_not_once_per_mc_sample(two_processes):
    """One BGPO update at n_t = 8 on two processes: bgpo.py all-reduces the gradient once per optimizer
    step (with --minibatches 2, once per mini-batch's update), in one buffer with the loss and the count of
    informative rows; DDP without no_sync would sync the whole gradient after each of the 8 backwards."""
    n_tiny = len(two_processes[0]["sft"]["params"])
    for result in two_processes:
        assert result["bgpo", 1]["all_reduce_sizes"] == [n_tiny + 2]
        assert result["bgpo", 2]["all_reduce_sizes"] == [n_tiny + 2] * 2
        assert result["bgpo", 4]["all_reduce_sizes"] == [n_tiny + 2] * 4   # one mini-batch then makes no step
        syncs = result["syncs"]
        n = syncs["n_params"]
        assert syncs["bgpo.py"] == [n + 2] and sum(syncs["DDP"]) == 8 * n, syncs
    mb = lambda numbers: f"{4 * numbers / 1e6:.1f} MB in float32"
    print(f"\none BGPO update at n_t = 8 of the default model ({n:,} parameters), 2 processes:\n"
          f"  bgpo.py:           1 all-reduce, {n + 2:,} numbers ({mb(n + 2)})\n"
          f"  DDP, no no_sync: {len(syncs['DDP'])} all-reduces (the gradient's buckets after each of 8 "
          f"backwards), {sum(syncs['DDP']):,} numbers ({mb(sum(syncs['DDP']))})")

def test_torchrun_runs_sft_and_rl_with_one_voice(tmp_path):
    """The real launcher, end to end on a tiny configuration: rank 0 alone prints and writes."""
    argv = DP_ARGV + ["--sft-steps", "2", "--rl-steps", "2", "--eval-every", "1", "--out-dir", str(tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run",   # the torchrun command
                "--standalone", "--nproc_per_node=2", "bgpo.py"]
    run = subprocess.run(torchrun + argv, cwd=os.path.dirname(bgpo.__file__), capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "terminate called" not in run.stderr and "Signal" not in run.stderr, run.stderr[-2000:]
    first = f"task arithmetic | device cpu | seed 0 | size cpu{cpu_size_why()} | 2 processes"
    assert run.stdout.count(first) == 1, run.stdout
    assert run.stdout.count("step    2 | reward") == 1, run.stdout        # rank 0 prints, rank 1 does not
    run_dir = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(run_dir) == 1 and run_dir[0].name.endswith("_2processes"), run_dir   # not a one-process run's
    run_dir = run_dir[0]
    assert [r["step"] for r in read_log(run_dir / "log.jsonl")] == [0, 1, 2]
    assert len(torch.load(run_dir / "ckpt.pt", weights_only=True)["rng"]) == 2   # every process's stream

def script_process(rank, port, argv, stderr_path):
    """One of two processes as torchrun starts them (its environment), started by processes_context, running
    bgpo.py as a script: its __main__ block, with its stderr (Python's and the C++ runtime's) in a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    sys.stderr = open(stderr_path, "w", buffering=1)
    os.dup2(sys.stderr.fileno(), 2)
    sys.argv = ["bgpo.py", *argv]
    runpy.run_path(bgpo.__file__, run_name="__main__")   # ends in sys.exit: the process's exit code

def two_script_processes(target, argv, tmp_path):
    """target(rank, port, argv, stderr file) as processes 0 and 1 of one group; fails if either still runs
    after 60 s. Returns their exit codes and their stderr."""
    port, context, errs = free_port(), processes_context(), [tmp_path / f"stderr{rank}" for rank in (0, 1)]
    processes = [context.Process(target=target, args=(rank, port, argv, errs[rank])) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        process.kill()
    assert not hung, f"processes {hung} still running after 60 s"
    return [process.exitcode for process in processes], [err.read_text() for err in errs]

def test_a_run_error_in_data_parallel_exits_2_on_every_process_without_hanging(tmp_path):
    """--stage rl without an SFT model: a RunError on both processes, after they joined the group. Each
    prints one line and leaves the group with the other (no abort, no hang) and exits with code 2."""
    argv = DP_ARGV + ["--stage", "rl", "--out-dir", str(tmp_path)]
    for rank, (code, err) in enumerate(zip(*two_script_processes(script_process, argv, tmp_path))):
        assert code == 2 and err.startswith("bgpo.py: error: no checkpoint at"), (rank, err)
        assert err.count("\n") == 1 and "terminate called" not in err, (rank, err[-2000:])

def out_of_memory_process(rank, port, argv, stderr_path):
    """script_process, but process 1 runs out of GPU memory (simulated) in its first RL step's rollouts."""
    real = tiny_dllm.generate

    def generate(*args, **kwargs):
        if rank == 1 and kwargs.get("temperature", 0) > 0:   # the evaluations are greedy
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)
    tiny_dllm.generate = generate   # what bgpo.py imports as a script
    script_process(rank, port, argv, stderr_path)

def test_out_of_memory_on_one_process_ends_both_without_hanging(tmp_path):
    """Process 1 alone runs out of memory while process 0 goes on to the update's all_reduce: process 1 says
    so in one line and leaves without waiting for the others (a barrier there would not match process 0's
    collective); process 0's collective then fails. Both exit non-zero, in seconds."""
    argv = DP_ARGV + ["--out-dir", str(tmp_path)]
    codes, errs = two_script_processes(out_of_memory_process, argv, tmp_path)
    assert codes[1] == 2 and errs[1].startswith("bgpo.py: error: out of GPU memory"), errs[1]
    assert codes[0] not in (0, None), errs[0][-2000:]

@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("extra, message", [
    (["--prompts-per-step", "3"], "2 processes x --minibatches 1 must divide --prompts-per-step 3"),
    (["--prompts-per-step", "2", "--minibatches", "2"], "2 processes x --minibatches 2 must divide"),
])
def test_a_bad_world_size_exits_2_with_one_line_on_every_process_before_any_collective(
        tmp_path, capsys, monkeypatch, rank, extra, message):
    """What each process that torchrun starts does first (main parses the flags before it joins the others):
    with a world size the flags do not divide into, it exits, so no process waits for another."""
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))
    with pytest.raises(SystemExit) as e:
        bgpo.main(tiny_argv(tmp_path, *extra))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not dist.is_initialized()

def test_every_process_decides_size_dtype_and_mc_chunk_from_every_processs_card(two_processes):
    """torchrun on one machine with two different cards: each process decides from both, so both run float32
    (the 2080 Ti has no bf16 tensor cores) with the --mc-chunk that the 11 GiB card holds (4: 4 x 1.06 GiB <=
    5.5), and look for one SFT file. Deciding each from its own card, process 0 would run bf16 with --mc-chunk
    8 and look for an SFT file that process 1, in float32, never writes."""
    decisions = [r["cards"] for r in two_processes]
    assert [d.pop("device") for d in decisions] == ["cuda:0", "cuda:1"]
    assert decisions[0] == decisions[1], decisions
    assert (decisions[0]["size"], decisions[0]["dtype"], decisions[0]["mc_chunk"]) == ("gpu", "float32", 4)
    why = " (--size auto: NVIDIA GeForce RTX 2080 Ti, 11 GiB, float32: --mc-chunk 4)"
    assert decisions[0]["first line"] == why

def test_data_parallel_averages_a_tensor_stat_without_waiting_and_numbers_as_numbers(two_processes):
    """SFT's loss, a 0-dim tensor, comes back a tensor holding the mean over the processes (1 and 3: 2); RL's
    numbers come back numbers (the loss 1 and 3: 2; the rows 0 and 3: 1.5)."""
    for result in (r["stats"] for r in two_processes):
        assert torch.is_tensor(result["tensor"]) and result["tensor"].item() == 2.0, result
        assert result["numbers"] == [2.0, 1.5] and all(type(n) is float for n in result["numbers"]), result

def test_data_parallel_processes_draw_their_own_shares_and_evaluate_a_share_each(two_processes, monkeypatch):
    """run_sft and run_rl's own draws: each process trains on SFT_BATCH / 2 demonstrations and samples
    --prompts-per-step / 2 prompts, not the other's; held-out evaluation decodes 6 and 5 of 11 problems on the
    two processes and gives one process's accuracy and mean reward."""
    first = [r["first batches"] for r in two_processes]
    assert [len(f["sft"]) for f in first] == [bgpo.SFT_BATCH // 2] * 2
    assert not torch.equal(first[0]["sft"], first[1]["sft"])
    assert [len(f["rl"]) for f in first] == [4, 4] and not set(first[0]["rl"]) & set(first[1]["rl"])
    decoded, accuracy, reward = dp_evaluate(DP_ARGV, monkeypatch.setattr)
    assert decoded == 11 and 0 < accuracy < 1
    assert [r["evaluate"] for r in two_processes] == [(6, accuracy, reward), (5, accuracy, reward)]

def test_data_parallel_resume_restores_every_processs_random_stream(two_processes):
    """--resume under two processes gives the run that was never interrupted: the checkpoint has each
    process's random stream (sampling from rank 0's on both would draw other rollouts on rank 1)."""
    for rank, result in enumerate(r["resume"] for r in two_processes):
        assert torch.equal(result["straight"], result["resumed"]), rank
        assert not torch.equal(result["straight"], result["initial"]), "RL should have moved the weights"
    assert torch.equal(two_processes[0]["resume"]["straight"], two_processes[1]["resume"]["straight"])
