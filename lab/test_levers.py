"""The levers of lab/levers.py do what they say: a dynamic batch holds only groups whose rewards differ, a
hinted rollout keeps its fixed tokens and is scored by the verifier, and the rand-order arm samples from the
random-order model (whose law test_estimators checks against enumeration)."""
import argparse
import json

import pytest
import torch

from lab import levers, rl, sweep
from lab.sampler import Rollouts, sample_rollouts
from tasks import encode, get_task
from tiny_dllm import ModelConfig, TinyDLLM

G = 4

def countdown_model(seed=0):
    task = get_task("countdown")
    torch.manual_seed(seed)
    model = TinyDLLM(ModelConfig(task.tokenizer.vocab_size, 1, 2, 16, task.prompt_len + task.gen_len,
                                 task.tokenizer.mask_id))
    return task, model

def sampler_args():
    return argparse.Namespace(device="cpu", temperature=1.3, gen_steps=None, block_len=None)

def fake_batch(rewards, tag):
    """Rollouts of len(rewards) / G prompts named tag0, tag1, ... with these rewards (tokens are row ids)."""
    B = len(rewards)
    prompts = [f"{tag}{i // G}" for i in range(B)]
    rows = torch.arange(B)[:, None]
    return Rollouts(prompts, rows.expand(B, 3), rows.expand(B, 5), rows.expand(B, 5), prompts,
                    torch.tensor(rewards, dtype=torch.float64))

def test_dynamic_batch_holds_only_groups_whose_rewards_differ_up_to_its_cap():
    """Batches drawn with 1, 0 and 2 groups whose rewards differ (of 3 each): with room for 2 groups the batch
    is the first batch's mixed group and the third's first one, each whole and with its own answer; with a cap
    of 2 batches it holds the one mixed group found; with none found, the last batch comes back whole."""
    tied, mixed = [0.0] * G, [1.0, 0.0, 0.1, 0.0]
    batches = [fake_batch(tied + mixed + tied, "a"), fake_batch(tied * 3, "b"), fake_batch(mixed * 3, "c")]

    def draw_from(queue):
        def draw():
            batch = queue.pop(0)
            return batch, [p + "=answer" for p in batch.prompts[::G]]
        return draw

    batch, answers, drawn, n = levers.dynamic_rollouts(draw_from(list(batches)), 2, G, max_batches=5)
    assert n == 3 and drawn.shape == (3, 3 * G)
    assert batch.prompts == ["a1"] * G + ["c0"] * G and answers == ["a1=answer", "c0=answer"]
    groups = batch.rewards.view(-1, G)
    assert (groups.amax(1) > groups.amin(1)).all()
    assert batch.y[:, 0].tolist() == list(range(G, 2 * G)) + list(range(G))      # whole groups, in order
    batch, answers, _, n = levers.dynamic_rollouts(draw_from(list(batches)), 2, G, max_batches=2)
    assert n == 2 and batch.prompts == ["a1"] * G and answers == ["a1=answer"]
    batch, answers, _, n = levers.dynamic_rollouts(draw_from([batches[1]] * 2), 2, G, max_batches=2)
    assert n == 2 and batch.prompts == batches[1].prompts and len(answers) == 3

def test_hinted_rollout_keeps_its_fixed_tokens_and_is_scored_by_the_verifier(monkeypatch):
    """--hints inpaint: each all-fail group asks for one rollout with part of its known answer fixed. Every
    hinted rollout keeps the fixed tokens (20-60% of L), its reward is the verifier's on its text, and it
    replaces its group's last rollout exactly when that reward is 1; groups with a solve are not touched. To
    reach both branches with an untrained model, the sampler's second hinted rollout is its known answer in
    full (which the hint allows: the fixed tokens are the answer's), scored again by the verifier."""
    task, model = countdown_model()
    prompts, answers = task.sample(3, "train", 0)
    args = sampler_args()
    batch = sample_rollouts(model, task, prompts, G, args, torch.Generator().manual_seed(0))
    batch.rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 0.1])                       # group 0 has a solve
    seen = {}

    def spy(model, task, prompts, group_size, args, generator, prior=None, **options):
        hinted = sample_rollouts(model, task, prompts, group_size, args, generator, prior=prior, **options)
        _, solution = encode(task, prompts, seen["answers"])
        hinted.y[1] = solution[1]
        hinted.texts[1] = task.decode(hinted.y[1])
        hinted.rewards = torch.tensor([task.reward(p, t) for p, t in zip(prompts, hinted.texts)])
        seen.update(prior=prior, hinted=hinted)
        return hinted

    seen["answers"] = answers[1:]
    monkeypatch.setattr(levers, "sample_rollouts", spy)
    out, got, failed = levers.hinted_rollouts(model, task, batch, answers, G, args,
                                              torch.Generator().manual_seed(1), "inpaint")
    assert failed.tolist() == [False, True, True]
    prior, hinted = seen["prior"], seen["hinted"]
    fixed = prior != task.tokenizer.mask_id
    L = task.gen_len
    assert ((fixed.sum(1) >= round(0.2 * L)) & (fixed.sum(1) <= round(0.6 * L))).all(), fixed.sum(1)
    assert (hinted.y[fixed] == prior[fixed]).all()
    assert hinted.rewards.tolist() == [task.reward(p, t) for p, t in zip(prompts[1:], hinted.texts)]
    assert hinted.rewards[1] == 1.0
    assert got.tolist() == [False, hinted.rewards[0].item() == 1.0, True]
    for group in range(3):
        for row in range(group * G, (group + 1) * G):
            replaced = got[group] and row == (group + 1) * G - 1
            expected = hinted.y[group - 1] if replaced else batch.y[row]
            assert torch.equal(out.y[row], expected), (group, row)
            assert out.rewards[row] == (1.0 if replaced else batch.rewards[row])

def test_solution_hint_is_the_known_answer_with_the_verifier_s_reward():
    """--hints solution (the SFT-like control): every all-fail group's last rollout becomes its known answer,
    which the verifier scores 1."""
    task, model = countdown_model()
    prompts, answers = task.sample(2, "train", 1)
    batch = sample_rollouts(model, task, prompts, G, sampler_args(), torch.Generator().manual_seed(0))
    batch.rewards[:] = 0.0
    out, got, _ = levers.hinted_rollouts(model, task, batch, answers, G, sampler_args(), None, "solution")
    assert got.all()
    last = torch.arange(len(batch.prompts)) % G == G - 1
    assert torch.equal(out.y[~last], batch.y[~last])
    for group, answer in enumerate(answers):
        row = (group + 1) * G - 1
        assert out.texts[row] == answer and out.rewards[row] == 1.0 == task.reward(prompts[group], answer)

def test_rand_order_arm_samples_the_random_order_model_at_temperature_1():
    """The rand-order arm's rollouts are lab.sampler's remasking="random" with one token per step at
    temperature 1: the law that test_random_remasking_samples_from_the_random_order_likelihood checks
    against enumeration."""
    args = rl.parse_args([*sweep.ARMS["rand-order"][1], "--device", "cpu"])
    assert (args.remasking, args.temperature, args.gen_steps, args.block_len) == ("random", 1.0, None, None)

def test_a_decayed_hint_fixes_a_scaled_share_of_the_solution_and_one_token_at_least():
    """--hint-decay: hint_prior with scale s fixes round(f s L) tokens of the known answer, f uniform in
    HINT_FRACTION (0.2-0.6), one at least; the fixed tokens are the answer's. By hand for Countdown's L = 10:
    scale 0.5 fixes 1-3 tokens, scale 0 exactly one."""
    task = get_task("countdown")
    answers = task.sample(64, "train", 0)[1]
    _, solution = encode(task, [""] * len(answers), answers)
    mask_id, L = task.tokenizer.mask_id, task.gen_len
    for scale, low, high in ((1.0, round(0.2 * L), round(0.6 * L)), (0.5, 1, round(0.3 * L)), (0.0, 1, 1)):
        prior = levers.hint_prior(task, answers, torch.Generator().manual_seed(0), mask_id, scale)
        fixed = prior != mask_id
        assert ((fixed.sum(1) >= low) & (fixed.sum(1) <= high)).all(), (scale, fixed.sum(1))
        assert (prior[fixed] == solution[fixed]).all()

def test_hints_inside_dynamic_sampling_make_a_failed_group_a_kept_one(tmp_path, monkeypatch):
    """The dyn-hint arm (--dynamic-batches 3 --hints ...): each drawn batch gets its hints before dynamic
    sampling keeps its mixed groups, so a group whose rollouts all fail but that a hint solves is kept. With
    every rollout failing (the sampler's rewards set to 0) and the known solution as the hint, each step draws
    one batch, every group hinted; without hints each step draws all 3 batches and keeps no group. The log's
    never-solved share is the policy's own rollouts', before the hints: 1 in both. Its seconds by phase add
    up: the hinted rollouts' within the rollouts', the update's within the rest."""
    real = rl.sample_rollouts

    def all_fail(*args, **kwargs):
        batch = real(*args, **kwargs)
        batch.rewards = torch.zeros_like(batch.rewards)
        return batch

    monkeypatch.setattr(rl, "sample_rollouts", all_fail)
    from lab.testing import tiny_argv
    logs = {}
    for name, extra in (("dyn-hint", ["--hints", "solution"]), ("dyn", [])):
        argv = tiny_argv(tmp_path, "--dynamic-batches", "3", "--run-name", name, "--sft-steps", "50", *extra)
        rl.main(argv)
        logs[name] = [json.loads(line) for line in open(tmp_path / name / "log.jsonl")][1:]
    assert [r["sampler_batches"] for r in logs["dyn-hint"]] == [1, 1]
    assert [r["hinted_groups"] for r in logs["dyn-hint"]] == [1.0, 1.0]
    assert [r["sampler_batches"] for r in logs["dyn"]] == [3, 3]
    assert [r["informative_rows"] for r in logs["dyn"]] == [0.0, 0.0]
    assert all(r["never_solved"] == 1.0 for name in logs for r in logs[name])
    # the step's seconds by phase: the hinted rollouts' within the rollouts', the update's apart
    for name, r in ((name, r) for name in logs for r in logs[name]):
        assert 0 <= r["hint_seconds"] <= r["rollout_seconds"] <= r["seconds"], (name, r)
        assert 0 <= r["update_seconds"] <= r["seconds"] - r["rollout_seconds"], (name, r)
        assert (r["hint_seconds"] > 0) == (name == "dyn-hint"), (name, r["hint_seconds"])

def test_hint_decay_is_an_option_of_inpainted_hints():
    for argv in (["--hint-decay"], ["--hints", "solution", "--hint-decay"]):
        try:
            rl.parse_args([*argv, "--device", "cpu"])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
    argv = ["--hints", "inpaint", "--hint-decay", "--device", "cpu"]
    assert "_hints-inpaint_decay_seed0" in rl.parse_args(argv).run_name

def test_probed_rollouts_keep_the_prompts_whose_probes_differ_first_and_complete_their_groups():
    """levers.probed_rollouts with a scripted sampler: 6 candidate prompts, 2 probe rollouts each, 3 kept in
    groups of 4. Prompts 1 and 4 have probes that differ (a solve and a miss): they come first, then prompt 0,
    the first of the others in the order drawn. Each kept group holds its own 2 probe rows, then 2 new ones,
    all of one prompt; the answers follow the kept prompts; the rows sampled are 6 x 2 + 3 x 2 of 3 x 4."""
    calls = []

    def sample(prompts, k):
        calls.append((list(prompts), k))
        rows = [p for p in prompts for _ in range(k)]
        first = len(calls) == 1
        rewards = torch.tensor([float(first and p in ("p1", "p4") and j == 0)
                                for p in prompts for j in range(k)])
        x = torch.tensor([[int(p[1])] for p in rows])
        y = torch.tensor([[int(p[1]), len(calls)] for p in rows])
        return Rollouts(rows, x, y, torch.zeros_like(y), [f"{p}/{len(calls)}" for p in rows], rewards)

    prompts, answers = [f"p{i}" for i in range(6)], [f"a{i}" for i in range(6)]
    batch, kept_answers, mixed, rows = levers.probed_rollouts(sample, prompts, answers, 4, 3, 2)
    assert calls == [(prompts, 2), (["p1", "p4", "p0"], 2)]
    assert batch.prompts == [p for p in ("p1", "p4", "p0") for _ in range(4)]
    assert batch.x[:, 0].tolist() == [1] * 4 + [4] * 4 + [0] * 4                 # each group one prompt
    assert batch.y[:, 1].tolist() == [1, 1, 2, 2] * 3                             # probe rows, then new ones
    assert batch.rewards.tolist() == [1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert kept_answers == ["a1", "a4", "a0"] and mixed == 2 / 3 and rows == (12 + 6) / 12

def test_the_probe_and_left_to_right_arms_run_and_log_what_they_do(tmp_path, monkeypatch):
    """lab.rl with --probe 2 (the sel arm) draws twice the prompts, keeps --prompts-per-step of them in full
    groups and logs the rows it sampled, (4 x 2 + 2 x 2) / (2 x 4); with --rollout-order left-to-right (the
    ltr arm) every rollout commits its tokens one a step from the left, while the greedy evaluations keep the
    confidence order (their commit steps are not in order)."""
    from lab.testing import tiny_argv
    seen, real = [], rl.sample_rollouts

    def watched(model, task, prompts, k, args, *rest, **options):
        batch = real(model, task, prompts, k, args, *rest, **options)
        seen.append(batch.commit_steps)
        return batch

    monkeypatch.setattr(rl, "sample_rollouts", watched)
    rl.main(tiny_argv(tmp_path, "--probe", "2", "--run-name", "sel", "--sft-steps", "50"))
    log = [json.loads(line) for line in open(tmp_path / "sel" / "log.jsonl")][1:]
    assert [r["sampler_batches"] for r in log] == [1.5, 1.5] and all(0 <= r["probe_mixed"] <= 1 for r in log)
    seen.clear()
    rl.main(tiny_argv(tmp_path, "--rollout-order", "left-to-right", "--run-name", "ltr", "--sft-steps", "50"))
    L = get_task("arithmetic").gen_len
    assert seen and all(torch.equal(steps, torch.arange(L).expand_as(steps)) for steps in seen)
    args = rl.parse_args(tiny_argv(tmp_path, *sweep.ARMS["ltr"][1]))
    assert args.block_len is None and args.gen_steps is None   # what the evaluations sample with
    bad_flags = (["--probe", "4"], ["--probe", "2", "--dynamic-batches", "3"],
                 ["--probe", "2", "--rl-pool", "8"])
    for bad in bad_flags:
        with pytest.raises(SystemExit):   # G - 1 probes at most; not with dynamic sampling or a fixed pool
            rl.parse_args(tiny_argv(tmp_path, *bad))
