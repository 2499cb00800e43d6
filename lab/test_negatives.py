"""lab.negatives: its exact measures, the sampler's frequency against the sampler's enumerated law, the two
halves of the update and a small step on each, and the command end to end."""
import argparse
import json
import math
import shutil

import pytest
import torch

import bgpo
from lab import negatives, objectives, rl
from lab.estimators import exact_elbo, random_order_log_likelihood, spg_upper_bound
from lab.sampler import Rollouts
from lab.testing import grads, on_policy_setup, random_batch, tiny_argv, tiny_model

def test_exact_measures_are_the_exact_functions_per_row():
    model = tiny_model().double()
    x, y = random_batch(B=3, L=5)
    m = negatives.exact_measures(model, x, y)
    for b in range(3):
        with torch.no_grad():
            elbo, log_likelihood = random_order_log_likelihood(model, x[b], y[b])
            assert m["elbo"][b].item() == pytest.approx(exact_elbo(model, x[b], y[b]).item(), abs=1e-10)
        assert m["log_likelihood"][b].item() == pytest.approx(log_likelihood.item(), abs=1e-10)
        assert m["elbo"][b].item() == pytest.approx(elbo.item(), abs=1e-10)
        bound = spg_upper_bound(model, x[b], y[b], objectives.SPG_BETA).item()
        assert m["spg_bound"][b].item() == pytest.approx(bound, abs=1e-10)
    assert (m["gap"] > 0).all()        # Jensen: the log of the mean over orders is above the mean of the logs

def test_sampler_frequency_matches_the_samplers_enumerated_law():
    """2-token completions of a tiny model at T 1.3: the law sums to 1, and the share of 6,000 draws that
    write each of the four likeliest completions is within 4.5 standard errors of its probability."""
    model = tiny_model(seed=1, scale=0.8)
    prompt = torch.tensor([5, 3, 7])
    law = negatives.sampler_law(model, prompt, 2, 1.3)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-9)
    likeliest = sorted(law, key=law.get, reverse=True)[:4]
    args = argparse.Namespace(gen_steps=None, block_len=None, temperature=1.3)
    freq, se = negatives.sampler_frequency(model, prompt.expand(4, -1), torch.tensor(likeliest), 4, 6000,
                                           args, torch.Generator().manual_seed(0))
    for completion, f, s in zip(likeliest, freq.tolist(), se.tolist()):
        assert abs(f - law[completion]) < 4.5 * max(s, 1e-3), (completion, f, law[completion], s)
    assert law[likeliest[0]] > 0.3 and law[likeliest[3]] > 0.02      # a peaked law, each within reach

def test_the_two_halves_add_up_to_the_update_and_a_small_step_moves_the_elbo_each_weights_its_way():
    """The halves' gradients sum to one bgpo_backward on the whole batch. The small step descends the half's
    loss -sum_b A_b ELBO_hat_b / (L B) on its rows, so to first order sum_b |A_b| ELBO_hat_b (the estimate on
    the same masks) falls on the A < 0 rows and rises on the A > 0 rows."""
    model, x, y, mc, _, A = on_policy_setup(M=6)
    args = rl.parse_args(["--stage", "rl", "--device", "cpu"])
    args.small_step = 1e-4
    batch = Rollouts(["?"] * 6, x, y, None, ["?"] * 6, torch.zeros(6))
    state = {"mc": mc, "old_terms": None}
    model.zero_grad()
    bgpo.bgpo_backward(model, x, y, mc, None, A)
    whole = grads(model).clone()
    halves = sum(negatives.half_gradient(model, batch, state, A, half, args) for half in negatives.HALVES)
    assert (halves - whole).abs().max() < 1e-12 and whole.abs().max() > 1e-3
    elbo_hat = lambda m: bgpo.elbo_terms(m, x, y, mc).mean(1).detach()         # (B,)
    before = elbo_hat(model)
    for half, rows in (("negative", A < 0), ("positive", A > 0)):
        after = elbo_hat(negatives.half_step(model, batch, state, A, half, "small", args))
        weighted = (A[rows].abs() * (after - before)[rows]).sum()
        assert (weighted < 0) if half == "negative" else (weighted > 0), (half, weighted)

def test_the_command_measures_a_batch_and_refuses_a_missing_sft_model(tmp_path, capsys):
    argv = tiny_argv(tmp_path, "--sft-steps", "30")
    with pytest.raises(SystemExit) as e:
        from lab.cli import command_line
        command_line(lambda: negatives.main([*argv, "--seeds", "0"]), "python -m lab.negatives")
    assert e.value.code == 2 and "no SFT model at" in capsys.readouterr().err
    rl.main([*argv, "--stage", "sft"])
    # W-REINFORCE's A is never 0: every group carries a signal, whatever the model solves
    table = negatives.main([*argv, "--seeds", "0", "--batches", "1", "--groups", "1", "--sampler-draws", "20",
                            "--advantages", "w-reinforce", "--neg-weight", "1"])
    measured = {(r["update"], r["step"], r["rows"], r["measure"]) for r in table}
    assert ("negative", "default", "negative", "sampler_frequency") in measured
    assert ("negative", "small", "negative", "elbo") in measured
    counts = {r["rows"]: r["n"] for r in table if (r["update"], r["step"], r["measure"]) == (
        "negative", "default", "elbo")}
    assert sum(counts.values()) == 4                                       # one group of G = 4
    assert json.load(open(tmp_path / "negatives.json"))["table"] == json.loads(json.dumps(table))
    sft_path = rl.sft_path(rl.parse_args(argv))
    rows = negatives.main([*argv, "--describe", sft_path, "--sampler-draws", "20"])
    assert len(rows) == 2 * 4 and all(r["gap"] > 0 and 0 <= r["sampler_frequency"] <= 1 for r in rows)
    # --track: a "run" holding the SFT model's own weights moves nothing; two real RL steps move the answers
    (tmp_path / "unchanged").mkdir()
    shutil.copy(sft_path, tmp_path / "unchanged" / "ckpt.pt")
    trained = [*argv, "--advantages", "w-reinforce", "--neg-weight", "1"]
    rl.main(trained)
    runs = f"{tmp_path / 'unchanged'},{tmp_path / rl.parse_args(trained).run_name}"
    rows = {(r["run"].split("/")[-1], r["measure"]): r["mean"]
            for r in negatives.main([*argv, "--seeds", "0", "--track", runs]) if r["answers"] == "wrong"}
    assert rows[("unchanged", "elbo")] == 0 and rows[("unchanged", "log_likelihood")] == 0
    moved = [v for (run, _), v in rows.items() if run != "unchanged"]
    assert len(moved) == 2 and all(v != 0 and math.isfinite(v) for v in moved), rows

def test_track_logs_reads_every_evaluation_and_pairs_the_runs_by_seed(tmp_path, capsys):
    """Two runs' logs with known tracked values: the change from step 0, each run minus the first paired by
    seed, and the figure's lines, worked out by hand."""
    values = {("a", 0): [-0.4, -0.6], ("a", 1): [-0.2, -0.3], ("b", 0): [-0.4, -1.1], ("b", 1): [-0.2, -0.8]}
    for (run, seed), (start, end) in values.items():
        folder = tmp_path / f"{run}_seed{seed}"
        folder.mkdir()
        records = [{"step": 0, "accuracy": 0.1, "track_wrong_log_pi": start, "track_right_log_pi": None},
                   {"step": 1, "reward": 0.5},
                   {"step": 2, "accuracy": 0.2, "track_wrong_log_pi": end, "track_right_log_pi": None}]
        (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = f"{tmp_path}/a_seed{{seed}},{tmp_path}/b_seed{{seed}}"
    figure = negatives.main(["--track-logs", runs, "--seeds", "0-1", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "a                        step 2, 2 seeds: -0.150" in out          # mean of -0.2 and -0.1
    assert "b                        step 2, 2 seeds: -0.650 " in out
    assert "minus the first -0.500 [-0.500, -0.500]" in out
    wrong = figure["panels"][0]["lines"]
    assert [line["label"] for line in wrong] == ["a", "b"] and wrong[1]["y"] == pytest.approx([-0.3, -0.95])
    assert figure["panels"][1]["lines"] == [], "no right answers tracked: no line"
