"""lab.entropy_law: the least-squares fit by hand, a law recovered from synthetic run logs, and bad input."""
import json
import math

import pytest

from lab import entropy_law

def test_the_fit_of_three_points_equals_its_least_squares_by_hand():
    """exp(H) = 1, 2, 3 and R = 0.3, 0.2, 0.2: slope sum (x - 2)(R - 7/30) / 2 = -0.1 / 2, so a = 0.05,
    b = 7/30 + 0.05 * 2 = 1/3; the residuals -1/60, 1/30, -1/60 give RMSE sqrt(1/1800)."""
    a, b, rmse = entropy_law.fit_law([0.0, math.log(2), math.log(3)], [0.3, 0.2, 0.2])
    assert a == pytest.approx(0.05) and b == pytest.approx(1 / 3) and rmse == pytest.approx(math.sqrt(1 / 1800))

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
        assert row["predicted"] == pytest.approx(b - a), "three evaluations up to step 50 already hold the law"
    assert result["runs"]["one"]["last_step"] == 125 and result["runs"]["two"]["last_accuracy"] == law(0.2)
    assert result["pooled"]["ceiling"] == pytest.approx(b - a)
    off = entropy_law.main([str(tmp_path / "off")])["runs"]["off"]
    assert off["rmse"] == pytest.approx(0.01, rel=0.3) and off["ceiling"] != pytest.approx(b - a, abs=1e-6)
    assert "pooled over 2 runs (11 points)" in capsys.readouterr().out

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
