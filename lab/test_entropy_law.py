"""lab.entropy_law (the least-squares fit by hand, a law recovered from synthetic run logs, bad input) and
lab.entropy_mechanism (one update's entropy change against its first-order law; the update's parts)."""
import json
import math

import pytest
import torch

import bgpo
from lab import cli, entropy_law, entropy_mechanism, rl
from lab.testing import grads, on_policy_setup, random_batch, report, tiny_argv
from tasks import encode, get_task

def test_the_fit_of_three_points_equals_its_least_squares_by_hand():
    """exp(H) = 1, 2, 3 and R = 0.3, 0.2, 0.2: slope sum (x - 2)(R - 7/30) / 2 = -0.1 / 2, so a = 0.05,
    b = 7/30 + 0.05 * 2 = 1/3; the residuals -1/60, 1/30, -1/60 give RMSE sqrt(1/1800)."""
    a, b, rmse = entropy_law.fit_law([0.0, math.log(2), math.log(3)], [0.3, 0.2, 0.2])
    assert a == pytest.approx(0.05) and b == pytest.approx(1 / 3)
    assert rmse == pytest.approx(math.sqrt(1 / 1800))

def write_run(folder, points, every=25):
    """A lab.rl-like log.jsonl: an evaluation record (accuracy, eval_entropy) every `every` steps, and step
    records between them without either."""
    folder.mkdir()
    records = []
    for i, (entropy, accuracy) in enumerate(points):
        records.append({"step": i * every, "accuracy": accuracy, "eval_entropy": entropy, "eval_reward": 0.5})
        if i + 1 < len(points):
            records += [{"step": i * every + k, "reward": 0.3, "entropy": 9.9} for k in range(1, every)]
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

def test_a_law_is_recovered_from_run_logs_and_its_early_fit_predicts_the_ceiling(tmp_path, capsys):
    a, b = 0.08, 0.32
    law = lambda entropy: b - a * math.exp(entropy)
    write_run(tmp_path / "one", [(h, law(h)) for h in (1.0, 0.8, 0.6, 0.5, 0.4, 0.35)])
    write_run(tmp_path / "two", [(h, law(h)) for h in (0.9, 0.7, 0.45, 0.3, 0.2)])
    write_run(tmp_path / "off", [(h, law(h) + 0.01 * (-1) ** i) for i, h in enumerate((1.0, 0.7, 0.5, 0.4))])
    result = entropy_law.main([str(tmp_path / name) for name in ("one", "two")] + ["--fit-steps", "50"])
    for name in ("one", "two"):
        row = result["runs"][name]
        assert row["a"] == pytest.approx(a) and row["b"] == pytest.approx(b) and row["rmse"] < 1e-12
        assert row["predicted"] == pytest.approx(b - a), "the evaluations up to step 50 already hold the law"
    assert result["runs"]["one"]["last_step"] == 125 and result["runs"]["two"]["last_accuracy"] == law(0.2)
    assert result["pooled"]["ceiling"] == pytest.approx(b - a)
    off = entropy_law.main([str(tmp_path / "off")])["runs"]["off"]
    assert off["rmse"] == pytest.approx(0.01, rel=0.3) and off["ceiling"] != pytest.approx(b - a, abs=1e-6)
    assert "pooled over 2 runs (11 points)" in capsys.readouterr().out

def test_runs_that_differ_by_a_flag_are_fitted_as_groups(tmp_path, capsys):
    """Two arms, each following its own law over two seeds (run.json flags as lab.rl writes them): each
    group's pooled fit recovers its law exactly; the fit over all four runs is neither."""
    laws = {0.0: (0.08, 0.32), 0.01: (0.02, 0.30)}
    for coef, (a, b) in laws.items():
        for seed in (0, 1):
            folder = tmp_path / f"run_{coef}_{seed}"
            write_run(folder, [(h, b - a * math.exp(h)) for h in (1.0 - 0.3 * seed, 0.7, 0.5, 0.3)])
            flags = {"seed": seed, "entropy_coef": coef, "lr": 1e-5, "run_name": folder.name}
            (folder / "run.json").write_text(json.dumps({"flags": flags}))
    result = entropy_law.main(sorted(str(run) for run in tmp_path.iterdir()))
    for coef, (a, b) in laws.items():
        group = result["groups"][f"--entropy-coef {coef}"]
        assert group["a"] == pytest.approx(a) and group["b"] == pytest.approx(b) and group["rmse"] < 1e-12
    assert result["pooled"]["rmse"] > 0.005, "the two laws pooled are no law"
    out = capsys.readouterr().out
    assert "pooled over 2 runs (8 points) --entropy-coef 0.01" in out and "pooled over 4 runs (16" in out

def test_runs_without_entropies_exit_2_with_one_line(tmp_path, capsys):
    write_run(tmp_path / "flat", [(0.5, 0.1), (0.5, 0.2)])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "log.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.1}) + "\n")
    for run, message in [("old", "fewer than 2 evaluations with an entropy"), ("missing", "no log.jsonl"),
                         ("flat", "two or more points with different entropies")]:
        with pytest.raises(SystemExit) as e:
            entropy_law.main([str(tmp_path / run)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, err

# -----------------------------------------------------------------------------
# lab.entropy_mechanism: one update's entropy change, its first-order law, and the parts of the update

def test_the_entropy_gradient_of_one_softmax_is_minus_p_times_log_p_plus_h():
    """dH/dz_v = -p_v (log p_v + H), by hand, against autograd; so dH = -Cov_p(log p, dz) to first order."""
    z = torch.tensor([0.3, -1.2, 2.0, 0.1], requires_grad=True)
    p = z.softmax(-1)
    H = -(p * p.log()).sum()
    H.backward()
    hand = -p.detach() * (p.detach().log() + H.detach())
    assert torch.allclose(z.grad, hand, atol=1e-12)
    dz = torch.tensor([0.01, -0.02, 0.005, 0.0])
    new_H = entropy_mechanism.entropy(z.detach() + dz)
    predicted = entropy_mechanism.first_order_change(z.detach(), z.detach() + dz)
    assert abs((new_H - H.detach()) - predicted) < 0.02 * abs(predicted), "first order, for a small dz"
    tenth = entropy_mechanism.entropy(z.detach() + dz / 10) - H.detach()
    assert abs(tenth - predicted / 10) < abs((new_H - H.detach()) - predicted) / 50, "the rest: second order"

def test_the_parts_of_the_update_add_up_to_bgpos_gradient_and_a_small_step_follows_the_first_order_law():
    model, x, y, mc, _, A = on_policy_setup(M=4)
    model.zero_grad(set_to_none=True)
    bgpo.bgpo_backward(model, x, y, mc, None, A)
    whole = grads(model)
    parts = entropy_mechanism.parts_of(model, x, y, mc, A)
    summed = sum(entropy_mechanism.term_gradient(model, x, y, mc, A, keep) for keep in parts.values())
    assert torch.allclose(summed, whole, rtol=1e-10, atol=1e-13), report(summed, whole)
    assert sum(int(k.sum()) for k in parts.values()) == int((mc.mask & (A != 0)[:, None, None]).sum())
    held_out = random_batch(B=5, P=3, L=5, seed=3)[0]
    H, rows = entropy_mechanism.measure(model, x, y, mc, A, held_out, 5, lr=1e-4)
    assert H > 0 and rows["whole update"][0] == 1.0
    for name, (share, measured, predicted) in rows.items():
        assert abs(measured - predicted) <= 0.02 * abs(predicted) + 1e-6, (name, measured, predicted)
    total = rows["whole update"][1]
    assert abs(sum(rows[n][1] for n in parts) - total) <= 0.02 * abs(total) + 1e-6, "the parts add up"

def test_the_mechanism_measures_the_checkpoint_it_is_given(tmp_path, capsys):
    """--checkpoint: that model is measured, not the SFT model: its H is the entropy of that model's first
    prediction on the same test prompts, computed here from its weights; a missing one exits 2."""
    argv = tiny_argv(tmp_path, "--sft-steps", "30")
    H_sft, _ = entropy_mechanism.main(argv + ["--prompts", "8"])          # trains the SFT model first
    args, task = rl.parse_args(argv), get_task("arithmetic")
    model = bgpo.load_model(rl.sft_path(args), task, args)
    with torch.no_grad():                                                  # another model: moved weights
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ckpt = str(tmp_path / "moved.pt")
    bgpo.save_checkpoint(ckpt, task, model.config, stage="rl", step=1, model=model.state_dict())
    H, _ = entropy_mechanism.main(argv + ["--prompts", "8", "--checkpoint", ckpt])
    held_out = encode(task, bgpo.test_problems(task, args)[:8], device="cpu")
    with torch.no_grad():
        expected = rl.entropy(rl.first_step_logits(model, held_out, task.gen_len)).mean().item()
    assert H == pytest.approx(expected, rel=1e-9) and abs(H - H_sft) > 1e-3
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.command_line(lambda: entropy_mechanism.main(argv + ["--checkpoint", ckpt + ".missing"]), "m")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "no checkpoint at" in err, err
