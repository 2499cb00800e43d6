"""
The field's RL objectives (lab/objectives.py) and the lab's RL diagnostics (lab/rl.py): each loss
against its value worked out by hand, each objective's on-policy gradient against that of its
estimate, the update built in two parts against the update in one, and RADD's cached sampler.
"""
import argparse
import math

import numpy as np
import pytest
import torch

import bgpo
from bgpo import bgpo_backward
from lab import control, objectives, rl, sampler
from lab.estimators import (dtrpo_log_likelihood, one_step_log_likelihood, stp_token_log_likelihood,
                            trajectory_log_likelihood)
from lab.radd import generate_radd
from lab.sampler import Rollouts
from lab.sampler import generate as lab_generate
from lab.testing import grads, on_policy_setup, random_batch, read_log, report, tiny_argv, tiny_model
from tasks import get_task
from tiny_dllm import ActivationMemory, generate

def lab_args(**settings):
    """The settings the objectives read, as lab.rl would give them."""
    return argparse.Namespace(**{"updates_per_batch": 2, "minibatches": 1, "mc_samples": 3, "block_len": None,
                                 "clip_eps": 0.2,
                                 "mc_chunk": 1, "anchors": False, **settings})

def logp_given(model, prompts, inputs, targets):
    """log p(targets_i | prompts, inputs) at every completion position, straight from the model: (B, L)."""
    logits = model(torch.cat([prompts, inputs], 1))[:, prompts.shape[1]:]
    return logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]

def clipped_by_hand(ratios, A, eps):
    """-mean of min(r A, clip(r, 1 - eps, 1 + eps) A) over a list of (ratio, advantage) pairs."""
    return -np.mean([min(r * a, min(max(r, 1 - eps), 1 + eps) * a) for r, a in zip(ratios, A)])

# log-ratios inside and outside the clip
DELTA = torch.tensor([[0.5, -0.1, 0.05, -0.6], [0.3, -0.4, 0.0, 0.15]], dtype=torch.float64)

ADV = torch.tensor([1.5, -0.7], dtype=torch.float64)

def test_diffu_grpo_loss_equals_the_per_token_clipped_ratio_worked_out_by_hand():
    model, (x, y) = tiny_model(), random_batch(B=2, P=3, L=4)
    hide = torch.tensor([[False, True, False], [True, False, True]])
    everything = torch.full_like(y, 1)                                     # MASK = 1
    hand = logp_given(model, x.masked_fill(hide, 1), everything, y).detach()
    loss = objectives.diffu_grpo_loss(model, x, y, hide, hand - DELTA, ADV, clip_eps=0.5)
    expected = clipped_by_hand(DELTA.exp().flatten().tolist(), ADV.repeat_interleave(4).tolist(), 0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-12)

def test_stp_loss_equals_the_per_token_clipped_ratio_of_the_weighted_copies_worked_out_by_hand():
    model, (x, y) = tiny_model(), random_batch(B=2, P=3, L=4)
    mask = torch.tensor([[[True, False, True, False], [False, False, False, True]],
                         [[True, True, False, False], [True, True, True, False]]])  # (B, n = 2, L)
    weight = torch.tensor([[2.0, 4.0], [1.5, 1.0]])
    hand = sum(weight[:, j, None] * mask[:, j] * logp_given(model, x, y.masked_fill(mask[:, j], 1), y)
               for j in range(2)).detach() / 2
    loss = objectives.stp_loss(model, x, y, bgpo.MCSamples(mask, weight), hand - DELTA, ADV, clip_eps=0.2)
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
    loss = objectives.dtrpo_loss(model, x, y, commit, steps, hand - 4 * delta, ADV, clip_eps=0.2)
    assert loss.item() == pytest.approx(clipped_by_hand(delta.exp().tolist(), ADV.tolist(), 0.2), rel=1e-12)

def test_dtrpo_dpo_loss_is_minus_log_sigmoid_of_beta_margin_and_has_no_gradient_for_equal_pairs():
    model, reference, (x, y) = tiny_model(), tiny_model(seed=1), random_batch(B=1, P=3, L=4)
    win, lose = y, y.flip(1)
    c_win, c_lose = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[3, 2, 1, 0]])
    steps = (torch.tensor([[1]]), torch.tensor([[0]]))
    # win at step 1: positions 1-3 masked, position 1 committed;
    # lose at step 0: all masked, position 3 committed
    state_w, state_l = torch.tensor([[False, True, True, True]]), torch.ones(1, 4, dtype=torch.bool)

    def R(m):
        return (4 * logp_given(m, x, win.masked_fill(state_w, 1), win)[0, 1]
                - 4 * logp_given(m, x, lose.masked_fill(state_l, 1), lose)[0, 3]).item()
    margin = R(model) - R(reference)
    loss = objectives.dtrpo_dpo_loss(model, reference, x, win, c_win, lose, c_lose, beta=0.5, steps=steps)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * margin))), rel=1e-12)

    model.zero_grad()
    objectives.dtrpo_dpo_loss(model, reference, x, win, c_win, win, c_win, beta=0.5,
                              steps=(steps[0], steps[0])).backward()
    assert grads(model).abs().max().item() == 0.0, "equal pairs: the two log-ratios cancel"

def test_each_field_objective_has_the_on_policy_gradient_of_its_estimate_on_the_same_draws():
    """On-policy (inner update 0), every loss has the gradient of -mean_b A_b X_b / L, X the estimate."""
    model, (x, _) = tiny_model(), random_batch(B=4, P=3, L=5)
    y, commit = generate(model, x, 5, temperature=1.0, generator=torch.Generator().manual_seed(0),
                         return_steps=True)
    batch, A = Rollouts(["?"] * 4, x, y, commit, None, None), torch.tensor([1.0, -0.5, 0.3, -0.8])
    estimate = {
        "diffu-grpo": lambda r: one_step_log_likelihood(model, x.masked_fill(r["prompt_mask"][:, 0], 1), y),
        "stp": lambda r: stp_token_log_likelihood(model, x, y, r["mc"][0]).sum(1),
        "dtrpo": lambda r: dtrpo_log_likelihood(model, x, y, commit, steps=r["steps"][:, 0])}
    for name, X in estimate.items():
        objective = objectives.OBJECTIVES[name]
        state = objective.prepare(model, batch, lab_args(), torch.Generator().manual_seed(1))
        model.zero_grad()
        objective.backward(model, batch, state, A, lab_args(), 0)
        g_loss = grads(model).clone()
        model.zero_grad()
        (-(A * X(state)).mean() / 5).backward()
        assert torch.allclose(g_loss, grads(model), rtol=1e-10, atol=1e-13), (
            f"{name}: {report(g_loss, grads(model))}")

def test_diffu_grpo_old_and_current_policy_see_the_same_prompt_mask_and_inner_updates_different_ones():
    model, (x, y) = tiny_model(), random_batch(B=8, P=6, L=4)
    batch, args, seen = Rollouts(["?"] * 8, x, y, None, None, None), lab_args(updates_per_batch=3), []
    model.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0][:, :6].clone()))
    state = objectives.diffu_grpo_draws(model, batch, args, torch.Generator().manual_seed(0))
    old = seen[:]  # the old policy, one pass per inner update
    for j in range(3):
        objectives.diffu_grpo_update(model, batch, state, torch.ones(8), args, j)
        assert torch.equal(seen[-1], old[j]), (
            f"inner update {j} sees the prompt mask its old values were computed on")
        assert (seen[-1] == 1).any(), "some prompt tokens are masked (p = 0.15 of 48)"
    assert not torch.equal(old[0], old[1]) and not torch.equal(old[1], old[2]), (
        "each inner update has its own mask")

def test_stp_rollout_never_changes_an_anchor_and_its_early_stop_leaves_no_mask_in_fewer_passes():
    model, (x, _) = tiny_model(max_len=3 + 8), random_batch(B=16, P=3, L=8)
    generator = torch.Generator().manual_seed(0)
    anchors = torch.rand(16, 8, generator=generator) < 0.3
    prior = torch.randint(2, 10, (16, 8), generator=generator).masked_fill(~anchors, 1)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    y, commit = lab_generate(model, x, 8, temperature=1.0, generator=generator, return_steps=True,
                             prior=prior, early_stop=0.5)
    assert torch.equal(y[anchors], prior[anchors]) and (commit[anchors] == -1).all(), (
        "anchors: in place, never committed")
    assert not (y == 1).any() and (commit[~anchors] >= 0).all(), "the early stop filled every masked position"
    passes = int(commit.max()) + 1
    assert len(calls) == passes < 8, (
        f"{len(calls)} forward passes, one per step that committed something, and the fill")
    placed_before_fill = anchors.sum(1) + ((commit >= 0) & (commit < passes - 1)).sum(1)
    assert (placed_before_fill >= 4).all(), "a row stops once int(0.5 * 8) tokens are in place"

def test_d1_advantages_are_the_reward_minus_the_group_mean():
    A = objectives.d1_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5]), 3)
    assert torch.allclose(A, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1 / 3, 1 / 6, 1 / 6]))

def test_trajectory_backward_is_the_gradient_of_the_trajectory_objective():
    """One backward per sampler step adds up to autograd through the whole trajectory sum."""
    model = tiny_model()
    x, _ = random_batch(B=4)
    y, commit = generate(model, x, 5, steps=3, temperature=1.0, generator=torch.Generator().manual_seed(0),
                         return_steps=True)
    A = torch.tensor([1.0, -0.5, 0.0, -0.5])
    loss = -(A * trajectory_log_likelihood(model, x, y, commit)).mean() / 5
    loss.backward()
    expected = grads(model).clone()
    model.zero_grad()
    value = objectives.trajectory_backward(model, x, y, commit, A)
    assert value == pytest.approx(loss.item(), abs=1e-12)
    assert torch.allclose(grads(model), expected, atol=1e-12), report(grads(model), expected)

def test_the_update_is_built_from_its_positive_and_negative_parts_and_adds_up_to_the_full_step():
    """lab.rl backpropagates the rows with A > 0 and those with A < 0 separately; the parts it reports
    must be the gradients of A+ and A- on the whole batch, and its step that of one backward on the batch."""
    model, x, y, mc, old_terms, A = on_policy_setup()
    parts = []
    for a in (A.clamp(min=0), A.clamp(max=0), A):
        model.zero_grad()
        bgpo_backward(model, x, y, mc, old_terms, a)
        parts.append(grads(model).clone())
    g_pos, g_neg, g_full = parts
    assert torch.allclose(g_pos + g_neg, g_full, atol=1e-12)
    batch, state, stats = Rollouts(["?"] * 6, x, y, None, None, None), {"mc": mc, "old_terms": old_terms}, {}
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    split = rl.split_by_sign(objectives.OBJECTIVES["bgpo"], stats)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer.zero_grad()
    loss = split.backward(model, batch, state, A, lab_args(updates_per_batch=1, mc_samples=6), 0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert stats["grad_pos"] == pytest.approx(g_pos.norm().item(), rel=1e-9)
    assert stats["grad_neg"] == pytest.approx(g_neg.norm().item(), rel=1e-9)
    cosine = (g_pos @ g_neg / (g_pos.norm() * g_neg.norm())).item()
    assert stats["cos_pos_neg"] == pytest.approx(cosine, rel=1e-9)
    assert loss == pytest.approx(-A.mean().item(), abs=1e-12)  # on-policy the bound's value is -mean A
    step = g_full * min(1.0, 1.0 / g_full.norm().item())  # clip_grad_norm_(1.0), then SGD lr 1
    assert torch.allclose(before - after, step, atol=1e-9), report(before - after, step)

def test_prediction_entropy_of_a_uniform_model_is_log_of_the_tokens_it_can_write():
    model = tiny_model()
    torch.nn.init.zeros_(model.head.weight)                                   # every logit 0; MASK's is -inf
    x, _ = random_batch(B=3)
    assert rl.prediction_entropy(model, x, 5) == pytest.approx(math.log(model.config.vocab_size - 1),
                                                               abs=1e-12)

def test_radd_cached_sampler_gives_the_same_samples_as_uncached():
    model = tiny_model()
    x, _ = random_batch(B=64, L=5)
    for temperature in (0.0, 1.0):
        (y1, calls1), (y2, calls2) = (generate_radd(model, x, 5, 20, temperature,
                                                    torch.Generator().manual_seed(3), cache)
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
    assert abs(calls.mean() - expected) < 4 * se, (
        f"mean calls {calls.mean():.4f}, expected {expected:.4f}, SE {se:.4f}")

@pytest.mark.parametrize("minibatches", ["1", "2"])
def test_the_lab_loop_with_bgpo_draws_what_bgpo_py_draws_and_makes_the_same_updates(tmp_path, monkeypatch,
                                                                                    minibatches):
    """lab.rl's loop is a copy of bgpo.run_rl's with its steps made replaceable: with --objective bgpo and no
    lab option it sees the same rollouts at every step, and its update (in two parts) differs from bgpo.py's
    (in one) by float rounding only, on-policy and with the paper's two mini-batches."""
    # a tiny model's groups all tie: fixed advantages of both signs make every step update
    fixed = lambda rewards, G: torch.linspace(-1, 1, len(rewards))
    monkeypatch.setattr(bgpo, "group_advantages", fixed)
    monkeypatch.setitem(objectives.ADVANTAGES, "group", fixed)
    same = ["--rl-steps", "3", "--minibatches", minibatches]
    bgpo.main(tiny_argv(tmp_path, *same, "--run-name", "tutorial"))
    rl.main(tiny_argv(tmp_path, *same, "--run-name", "lab", "--stage", "rl"))
    logs = [read_log(tmp_path / name / "log.jsonl") for name in ("tutorial", "lab")]
    assert [r["step"] for r in logs[1]] == [0, 1, 2, 3]
    for key in ("reward", "reward_std", "solved", "mixed_groups", "accuracy", "eval_reward"):
        assert [r.get(key) for r in logs[0]] == [r.get(key) for r in logs[1]], key
    weights = [torch.load(tmp_path / name / "ckpt.pt", weights_only=True)["model"]
               for name in ("tutorial", "lab")]
    sft = torch.load(bgpo.sft_path(bgpo.parse_args(tiny_argv(tmp_path, *same))), weights_only=True)["model"]
    assert any(not torch.equal(value, sft[name]) for name, value in weights[0].items()), (
        "RL moved the weights")
    for name, value in weights[0].items():
        assert torch.allclose(value, weights[1][name], rtol=0, atol=1e-12), name

def test_the_lab_sampler_without_its_options_is_tiny_dllm_generate_draw_for_draw():
    """lab.sampler.generate with no prior, no early stop and low-confidence remasking gives generate's
    completions and commit steps, from the same generator state, with blocks and uneven steps per block."""
    model, (x, _) = tiny_model(max_len=3 + 7), random_batch(B=6, P=3, L=7)
    for temperature, steps, block_len in ((0.0, None, None), (1.0, 7, None), (1.3, 5, 3), (1.0, 3, 3)):
        runs = [sample(model, x, 7, steps=steps, block_len=block_len, temperature=temperature,
                       generator=torch.Generator().manual_seed(0), return_steps=True)
                for sample in (generate, lab_generate)]
        assert all(torch.equal(a, b) for a, b in zip(*runs)), (temperature, steps, block_len)

def test_the_lab_rollouts_and_evaluation_with_its_default_flags_are_bgpo_pys(tmp_path):
    """lab.sampler's sample_rollouts and evaluate copy bgpo.py's: with the lab's defaults (bgpo.py's
    constants, no sampler option) they give the same completions, rewards and scores."""
    args, lab_args, task = bgpo.parse_args(tiny_argv(tmp_path)), rl.parse_args(tiny_argv(tmp_path)), \
        get_task("arithmetic")
    torch.manual_seed(0)
    model = bgpo.make_model(task, args)
    prompts = task.sample(3, "train", 0)[0]
    x, y, rewards = bgpo.sample_rollouts(model, task, prompts, args, torch.Generator().manual_seed(1))
    options = objectives.sampler_options(task, prompts, lab_args)
    batch = sampler.sample_rollouts(model, task, prompts, lab_args.group_size, lab_args,
                                    torch.Generator().manual_seed(1), **options)
    assert torch.equal(x, batch.x) and torch.equal(y, batch.y) and torch.equal(rewards, batch.rewards)
    held_out = bgpo.test_problems(task, args)
    assert bgpo.evaluate(model, task, held_out, args) == sampler.evaluate(model, task, held_out, lab_args)

def test_the_controls_sft_step_is_a_step_of_bgpo_run_sft(tmp_path):
    """lab.rl.sft_step (lab.control's and --sft-stop's) copies bgpo.run_sft's loop body: two of its steps give
    the weights that run_sft keeps after two steps."""
    args, task = bgpo.parse_args(tiny_argv(tmp_path, "--sft-steps", "2", "--sft-eval-every", "2")), \
        get_task("arithmetic")
    kept = bgpo.run_sft(args, task)
    torch.manual_seed(args.seed)
    model = bgpo.make_model(task, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=bgpo.SFT_LR, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    batches = bgpo.sft_batches(task, args, generator)
    for step in (1, 2):
        rl.sft_step(model, optimizer, *next(batches), bgpo.sft_lr_at(args, step), generator)
    for (name, a), b in zip(kept.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name}: {report(a, b)}"

@pytest.mark.parametrize("task_name, prompt, completion, valid", [
    ("countdown", "15,4,1:64", "15*4+1", True),             # right numbers, wrong value: still valid
    ("countdown", "15,4,1:64", "4+11+5", False),            # numbers not in the prompt: the collapse
    ("countdown", "15,4,1:64", "15*4", False),              # a number dropped
    ("countdown", "15,4,1:64", "((((", False),
    ("countdown", "15,4,1:64", "15*4+1$$$$", True),         # the answer ends at EOS
    ("arithmetic", "12+30=", "41", True),
    ("arithmetic", "12+30=", "4+1", False),
    ("sudoku", "12.4|3.1.|....|..3.", "1234341221434132", True),   # keeps the givens (not a solution)
    ("sudoku", "12.4|3.1.|....|..3.", "2134341221434132", False),  # changes a given
    ("sudoku", "12.4|3.1.|....|..3.", "123434122143413", False),   # 15 cells
])
def test_valid_says_whether_an_answer_is_well_formed(task_name, prompt, completion, valid):
    assert rl.valid(get_task(task_name), prompt, completion) is valid

# -----------------------------------------------------------------------------
# What BGPO's bound buys: the exact naive gradient in one sample's memory, and each lemma alone

def off_policy_setup(M=6, scale=0.05):
    """on_policy_setup with the parameters moved away from the old policy's: d_j != 0."""
    model, x, y, mc, old_terms, A = on_policy_setup(M)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model, x, y, mc, old_terms, A

@pytest.mark.parametrize("clip_eps", [None, 0.2, 0.02])
def test_naive_two_pass_gradient_equals_the_one_graph_naive_gradient_off_policy(clip_eps):
    """At clip 0.02 some sequences' ratios are clipped (their gradient is 0), others are not."""
    model, x, y, mc, old_terms, A = off_policy_setup()
    loss = bgpo.naive_loss(model, x, y, mc, old_terms, A, clip_eps)
    loss.backward()
    one_graph = grads(model)
    model.zero_grad()
    two_pass_loss = objectives.naive_two_pass_backward(model, x, y, mc, old_terms, A, clip_eps)
    with torch.no_grad():
        ratio = ((bgpo.elbo_terms(model, x, y, mc) - old_terms) / y.shape[1]).mean(1).exp()
    clipped = (A != 0) & (bgpo.ppo_clip(ratio, A, clip_eps) < ratio * A)
    if clip_eps == 0.02:
        assert 0 < int(clipped.sum()) < int((A != 0).sum()), (ratio, A)   # both kinds of sequence present
    rel = ((grads(model) - one_graph).norm() / one_graph.norm()).item()
    assert rel < 1e-12 and two_pass_loss == pytest.approx(loss.item(), rel=1e-12), (rel, ratio)

def test_naive_two_pass_equals_bgpo_on_policy():
    model, x, y, mc, old_terms, A = on_policy_setup()
    loss = bgpo_backward(model, x, y, mc, None, A)
    bound = grads(model)
    model.zero_grad()
    assert objectives.naive_two_pass_backward(model, x, y, mc, None, A) == pytest.approx(loss, rel=1e-12)
    assert ((grads(model) - bound).norm() / bound.norm()).item() < 1e-12

def test_spg_without_its_upper_bound_is_bgpo_on_policy_and_the_bound_changes_only_the_negative_rows():
    model, x, y, mc, old_terms, A = on_policy_setup()
    bgpo_backward(model, x, y, mc, None, A)
    bound = grads(model)
    model.zero_grad()
    objectives.spg_loss(model, x, y, mc, A, mix=0.0).backward()
    assert ((grads(model) - bound).norm() / bound.norm()).item() < 1e-12
    rows = A >= 0   # the rows with A = 0 count in the mean, as in spg_loss over the whole batch
    for mix in (0.0, 1.0):
        model.zero_grad()
        part = objectives.rows_of(mc, rows)
        objectives.spg_loss(model, x[rows], y[rows], part, A[rows], mix=mix).backward()
        positive = grads(model)
        assert mix == 0.0 or ((positive - reference).norm() / reference.norm()).item() < 1e-12
        reference = positive
    model.zero_grad()
    objectives.spg_loss(model, x, y, mc, A, mix=1.0).backward()
    assert ((grads(model) - bound).norm() / bound.norm()).item() > 1e-3

def test_spg_eubo_by_hand_leaves_out_a_position_masked_in_no_copy_with_a_finite_gradient():
    model, x, y, mc, old_terms, A = on_policy_setup(M=3)
    mask = mc.mask.clone()
    mask[:, :, 0] = False                                 # position 0 is masked in no copy
    mask[:, :, 1] = True                                  # and every copy masks something
    mc = bgpo.MCSamples(mask, mc.weight)
    logp = objectives.copy_token_log_probs(model, x, y, mc)                    # (B, M, L)
    value = objectives.spg_eubo(logp, mc, beta=2.0)
    (B, M, L) = mask.shape
    for b in range(B):
        per_token = [math.log(sum(mc.weight[b, j].item() * math.exp(2 * logp[b, j, i].item())
                                  for j in range(M) if mask[b, j, i]) / M) / 2
                     for i in range(L) if mask[b, :, i].any()]
        assert value[b].item() == pytest.approx(sum(per_token) / len(per_token), abs=1e-12)
    value.sum().backward()
    assert torch.isfinite(grads(model)).all()

def test_naive_two_pass_activation_memory_is_flat_in_n_t_like_bgpo():
    peak = {}
    for M in (1, 16):
        model, x, y, mc, old_terms, A = off_policy_setup(M)
        with ActivationMemory(model) as two_pass:
            objectives.naive_two_pass_backward(model, x, y, mc, old_terms, A, 0.2)
        with ActivationMemory(model) as bound:
            bgpo_backward(model, x, y, mc, old_terms, A, 0.2)
        with ActivationMemory(model) as one_graph:
            bgpo.naive_loss(model, x, y, mc, old_terms, A, 0.2).backward()
        peak[M] = two_pass.peak, bound.peak, one_graph.peak
    print(f"peak activation bytes (two-pass, BGPO, one graph): n_t=1 {peak[1]}, n_t=16 {peak[16]}")
    assert peak[16][0] <= 1.1 * peak[1][0] and peak[16][0] <= 1.1 * peak[16][1], "one sample's, as BGPO's"
    assert peak[16][2] >= 8 * peak[1][2], "the one-graph naive objective keeps all n_t graphs"

def test_bound_backward_with_bgpo_bound_is_bgpo_backward_off_policy():
    model, x, y, mc, old_terms, A = off_policy_setup()
    loss = bgpo_backward(model, x, y, mc, old_terms, A, 0.2)
    expected = grads(model)
    model.zero_grad()
    assert objectives.bound_backward(model, x, y, mc, old_terms, A, bgpo.bgpo_bound, 0.2) == \
        pytest.approx(loss, rel=1e-12)
    assert ((grads(model) - expected).norm() / expected.norm()).item() < 1e-12

@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_which_bounds_lie_below_the_naive_objective_for_which_sign_of_A(clip_eps):
    """On random log-ratios and advantages, summed over the n_t samples:
    BGPO's bound <= R_hat for every A; Lemma 1 alone (1 + d_j) <= R_hat where A >= 0; Lemma 2 alone
    (e^{d_j}) <= R_hat where A <= 0. Each holds with PPO's clip too (per-sample clip, Jensen on a
    concave monotone function). For the other sign neither lemma alone is a lower bound: without the clip
    it is an upper bound, strictly above on some draws; with the clip it lies on either side."""
    generator = torch.Generator().manual_seed(0)
    n_t = 8
    d = 0.4 * torch.randn(4000, n_t, generator=generator)
    A = torch.randn(4000, generator=generator)
    naive = bgpo.naive_objective(d, A, clip_eps)
    tol = 1e-12
    lemma1 = objectives.lemma1_bound(d, A, n_t, clip_eps).sum(1)
    lemma2 = objectives.lemma2_bound(d, A, n_t, clip_eps).sum(1)
    both = bgpo.bgpo_bound(d, A, n_t, clip_eps).sum(1)
    assert (both <= naive + tol).all()
    assert (lemma1[A >= 0] <= naive[A >= 0] + tol).all() and (lemma2[A <= 0] <= naive[A <= 0] + tol).all()
    assert torch.equal(both, torch.where(A >= 0, lemma1, lemma2)), "BGPO picks Lemma 1 or 2 by A's sign"
    above = (lemma1[A < 0] > naive[A < 0] + 1e-3).any() and (lemma2[A > 0] > naive[A > 0] + 1e-3).any()
    assert above, "for the other sign each lemma alone is not a lower bound"
    if clip_eps is None:
        assert (lemma1[A < 0] >= naive[A < 0] - tol).all() and (lemma2[A > 0] >= naive[A > 0] - tol).all()
    else:  # nor an upper bound: with the clip some rows lie below
        assert (lemma1[A < 0] < naive[A < 0] - 1e-3).any() and (lemma2[A > 0] < naive[A > 0] - 1e-3).any()

# -----------------------------------------------------------------------------
# BGPO's entropy levers: off, the same update; the covariance detach and the entropy bonus by hand

def spared_grads(model, setup, **levers):
    _, x, y, mc, old_terms, A = setup
    model.zero_grad(set_to_none=True)
    objectives.spared_bgpo_backward(model, x, y, mc, old_terms, A, **levers)
    return grads(model)

@pytest.mark.parametrize("policy", ["on", "off"])
def test_the_entropy_levers_off_are_bgpo_backward(policy):
    setup = on_policy_setup()
    model, x, y, mc, old_terms, A = setup
    old = None if policy == "on" else old_terms
    if policy == "off":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    model.zero_grad(set_to_none=True)
    bgpo_backward(model, x, y, mc, old, A, clip_eps=0.2 if old is not None else None)
    expected = grads(model)
    got = spared_grads(model, (model, x, y, mc, old, A), clip_eps=0.2 if old is not None else None)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12), report(got, expected)

@pytest.mark.parametrize("fraction", [0.25, -0.25])
def test_the_covariance_detach_drops_the_top_covariance_positions_gradient_worked_out_by_hand(fraction):
    """On-policy the update is -mean_b (A_b / n_t) sum_j w_bj sum_{i masked} log p_bji / L; with cov_detach
    the chosen positions' terms leave the sum. The choice by hand: per copy, cov over its masked positions,
    the top round(fraction x count), or for a negative fraction the bottom."""
    setup = on_policy_setup(M=4)
    model, x, y, mc, _, A = setup
    B, M, L = mc.mask.shape
    got = spared_grads(model, setup, cov_detach=fraction)
    model.zero_grad(set_to_none=True)
    total, chosen = 0.0, 0
    for j in range(M):
        rows = [model(torch.cat([x[b], y[b].masked_fill(mc.mask[b, j], 1)])[None])[0, 3:] for b in range(B)]
        logp = torch.stack([torch.stack([torch.log_softmax(rows[b][i], -1)[y[b, i]] for i in range(L)])
                            for b in range(B)])                                        # (B, L), row by row
        values = logp.detach()
        positions = [(b, i) for b in range(B) for i in range(L) if mc.mask[b, j, i]]
        mean_logp = sum(values[b, i] for b, i in positions) / len(positions)
        cov = {(b, i): (values[b, i] - mean_logp) * (A[b] - A.mean()) for b, i in positions}
        order = sorted(positions, key=lambda p: -cov[p])                              # highest first
        top = (order if fraction > 0 else order[::-1])[:max(1, round(abs(fraction) * len(positions)))]
        chosen += len(top)
        kept = sum(mc.weight[b, j] * logp[b, i] * A[b] for b, i in positions if (b, i) not in top)
        total = total - kept / (M * L * B)
    total.backward()
    expected = grads(model)
    assert chosen >= M and torch.allclose(got, expected, rtol=1e-9, atol=1e-12), report(got, expected)
    assert not torch.allclose(got, spared_grads(model, setup), atol=1e-6), "the detach changes the update"

def test_the_entropy_bonus_adds_the_gradient_of_the_copies_mean_masked_entropy():
    setup = on_policy_setup(M=3)
    model, x, y, mc, _, A = setup
    coef, (B, M, L) = 0.3, mc.mask.shape
    with_bonus, without = spared_grads(model, setup, entropy_coef=coef), spared_grads(model, setup)
    model.zero_grad(set_to_none=True)
    bonus = 0.0
    for j in range(M):
        probs = model(torch.cat([x, y.masked_fill(mc.mask[:, j], 1)], 1))[:, 3:].softmax(-1)   # (B, L, V)
        entropy = -(probs * probs.clamp(min=1e-300).log()).sum(-1)
        bonus = bonus + coef * entropy[mc.mask[:, j]].mean() / M
    (-bonus).backward()
    assert torch.allclose(with_bonus - without, grads(model), rtol=1e-9, atol=1e-12)

def test_the_covariance_detach_keeps_memory_flat_in_n_t():
    model, x, y, _, _, _ = on_policy_setup()
    A = torch.tensor([1.5, -0.5, 0.3, -1.2, 0.7, -0.1])
    peaks = []
    for n_t in (1, 16):   # the copies' mask counts differ, and with them the detached positions: a few bytes
        mc = bgpo.draw_mc_samples(6, 5, n_t, torch.Generator().manual_seed(1))
        with ActivationMemory(model) as memory:
            objectives.spared_bgpo_backward(model, x, y, mc, None, A, cov_detach=0.1, entropy_coef=0.1)
        peaks.append(memory.peak)
    assert 0 < peaks[1] <= 1.1 * peaks[0], f"peak activation bytes at n_t = 1 and 16: {peaks}"

def test_lab_rl_runs_bgpo_with_both_entropy_levers(tmp_path, monkeypatch):
    real, levers = objectives.spared_bgpo_backward, []

    def spy(*args, **kwargs):
        levers.append(args[-2:])
        return real(*args, **kwargs)

    monkeypatch.setattr(objectives, "spared_bgpo_backward", spy)
    arithmetic = type(get_task("arithmetic"))
    monkeypatch.setattr(arithmetic, "reward", lambda self, prompt, text: float(len(text) % 2))   # they differ
    argv = tiny_argv(tmp_path, "--sft-steps", "2", "--sft-eval-every", "2", "--rl-steps", "2",
                     "--cov-detach", "0.1", "--entropy-coef", "0.2")
    history = rl.main(argv)
    args = rl.parse_args(argv)
    assert [h["step"] for h in history] == [0, 1, 2]
    assert args.run_name.startswith("arithmetic_bgpo_nt4_seed0_")
    assert levers and set(levers) == {(0.1, 0.2)}, levers   # rewards that differ: updates, with both levers

def test_the_labs_reward_groups_refuses_what_bgpo_group_advantages_refuses():
    """lab.objectives.reward_groups copies bgpo.group_advantages's checks: the same bad rewards and group
    sizes raise the same one-line ValueError in both, and good ones give the same (B / G, G) groups."""
    rewards = torch.arange(8.0)
    for bad in ((rewards, 3), (rewards, 1), (rewards, 2.0), (rewards.view(2, 4), 4)):
        messages = []
        for check in (objectives.reward_groups, bgpo.group_advantages):
            with pytest.raises(ValueError) as error:
                check(*bad)
            messages.append(str(error.value))
        assert messages[0] == messages[1], messages
    assert torch.equal(objectives.reward_groups(rewards, 4), rewards.view(2, 4))
