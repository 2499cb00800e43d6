"""
The sweep (python -m lab.sweep) and its arms: the RFT arm's update against BGPO's with hand-made advantages,
each ablation arm's flags against the default's, the intervals against published t quantiles and by hand,
a tiny sweep end to end, and its worker pool's order and failures.
"""
import itertools
import json
import math
import os
import re
import sys

import pytest
import torch

import bgpo
from lab import control, negatives, objectives, rl, sweep
from lab.sampler import Rollouts
from lab.testing import grads, on_policy_setup, read_log, tiny_argv
from tasks import get_task

CPU = ["--device", "cpu"]   # flags' logic, the same on a machine that sees a CUDA card

def test_the_rft_update_is_the_bgpo_update_with_advantage_1_on_solved_rollouts_and_0_elsewhere():
    """lab.rl --advantages rft, through the lab's update (rows with A = 0 dropped, the rest rescaled, the
    positive and negative parts built apart), against one bgpo_backward on the whole batch, A = 1[r = 1]."""
    model, x, y, mc, _, _ = on_policy_setup(M=6)
    rewards = torch.tensor([1.0, 0.1, 0.0, 1.0, 1.0, 0.1])                    # two groups of 3
    A = objectives.ADVANTAGES["rft"](rewards, 3)
    assert A.tolist() == [1, 0, 0, 1, 1, 0]
    model.zero_grad()
    bgpo.bgpo_backward(model, x, y, mc, None, (rewards == 1.0).double())
    expected = grads(model).clone()
    model.zero_grad()
    args = rl.parse_args(["--advantages", "rft", "--device", "cpu"])
    batch = Rollouts(["?"] * 6, x, y, None, None, None)
    rl.split_by_sign(objectives.OBJECTIVES["bgpo"], {}).backward(model, batch, {"mc": mc, "old_terms": None},
                                                                 torch.where(A < 0, args.neg_weight * A, A),
                                                                 args, 0)
    diff = (grads(model) - expected).abs().max().item()
    assert diff < 1e-12 and expected.abs().max() > 1e-3, diff

def test_w_reinforce_advantages_by_hand():
    """+0.1 on a solved rollout (reward 1), -1 on the rest, the 0.1 of a well-formed wrong answer included."""
    rewards = torch.tensor([1.0, 0.1, 0.0, 1.0, 1.0, 0.1])
    expected = [0.1, -1, -1, 0.1, 0.1, -1]
    assert objectives.ADVANTAGES["w-reinforce"](rewards, 3).tolist() == pytest.approx(expected)
    assert rl.parse_args(sweep.arm_argv("w-reinforce", 0, CPU, 2000)).neg_weight == 1.0    # -1 is not halved

def test_each_ablation_arm_changes_only_the_setting_its_name_says():
    base = vars(rl.parse_args(["--stage", "rl", "--device", "cpu"]))
    changed = {}
    arms = ("nt1", "neg-weight-1", "rft", "no-std", "solved-reward", "g16", "g32", "w-reinforce", "spg",
            "cov-detach", "entropy-bonus")
    for arm in arms:
        args = vars(rl.parse_args(sweep.arm_argv(arm, 0, CPU, 2000)))
        changed[arm] = {k for k in base if args[k] != base[k]} - {"run_name", "final_eval_size"}
        assert args["run_name"] != base["run_name"], arm              # and so its own folder
    assert changed == {"nt1": {"mc_samples"}, "neg-weight-1": {"neg_weight"}, "rft": {"advantages"},
                       "no-std": {"advantages"}, "solved-reward": {"reward"},
                       "g16": {"group_size", "prompts_per_step"}, "g32": {"group_size", "prompts_per_step"},
                       "w-reinforce": {"advantages", "neg_weight"}, "spg": {"objective"},
                       "cov-detach": {"cov_detach"}, "entropy-bonus": {"entropy_coef"}}
    assert rl.parse_args(sweep.arm_argv("nt1", 0, CPU, 2000)).mc_samples == 1
    for arm, n_t, prompts in [("nt32", 32, 16), ("nt16-p9", 16, 9), ("nt4-p25", 4, 25), ("nt2-p34", 2, 34)]:
        args = rl.parse_args(sweep.arm_argv(arm, 0, CPU, 2000))
        assert (args.mc_samples, args.prompts_per_step) == (n_t, prompts), arm
        L = get_task("countdown").gen_len   # bench_step's count: rows x (L + 3 n_t) token passes a step
        assert abs(prompts * (L + 3 * n_t) / (16 * (L + 3 * 8)) - 1) < 0.05 or arm == "nt32", arm
    assert rl.parse_args(sweep.arm_argv("neg-weight-1", 0, CPU, 2000)).neg_weight == 1.0

@pytest.mark.parametrize("df, published", [(1, 12.706), (4, 2.776), (9, 2.262), (29, 2.045)])
def test_t_quantile_matches_the_published_table(df, published):
    assert sweep.t_quantile(0.975, df) == pytest.approx(published, abs=1e-3)

def test_table_intervals_and_paired_differences_by_hand():
    """Two seeds: mean +- t_{0.975,1} s / sqrt(2), with t_{0.975,1} = 12.706 and s = |a - b| / sqrt(2)."""
    run = lambda accuracy, sft: {"accuracy": accuracy, "sft_accuracy": sft}
    finals = {"bgpo": {0: run(0.30, 0.10), 1: run(0.20, 0.14)},
              "rft": {0: run(0.25, 0.10), 1: run(0.19, 0.14)}}
    rows = {row[0]: row for row in sweep.table(finals, "bgpo")}
    half = lambda a, b: 12.706 * abs(a - b) / math.sqrt(2) / math.sqrt(2)
    for got, (mean, width) in [(rows["SFT model"][2], (0.12, half(0.10, 0.14))),
                               (rows["bgpo"][2], (0.25, half(0.30, 0.20))),
                               (rows["bgpo"][3], (0.13, half(0.20, 0.06))),      # minus SFT: 0.20, 0.06
                               (rows["rft"][4], (-0.03, half(-0.05, -0.01)))]:   # minus bgpo: -0.05, -0.01
        assert got[0] == pytest.approx(mean) and got[1] == pytest.approx(width, rel=1e-4)
    assert rows["bgpo"][4] is None and rows["rft"][1] == [0, 1]
    scored = [*finals["bgpo"].values(), finals["rft"][0]]
    for f, (value, sft) in zip(scored, [(1.0, 1.5), (0.8, 1.1), (0.7, 1.5)]):
        f.update(entropy=value, sft_entropy=sft)   # seed 1's rft run was scored before the entropy was
    rows = {row[0]: row for row in sweep.table(finals, "bgpo", "entropy")}
    assert rows["rft"][1] == [0] and rows["rft"][4][0] == pytest.approx(-0.3)
    assert math.isnan(rows["rft"][4][1])   # one pair: no interval
    assert rows["bgpo"][3][0] == pytest.approx(-0.4)
    assert rows["bgpo"][3][1] == pytest.approx(half(-0.5, -0.3), rel=1e-4)
    assert sweep.table(finals, "bgpo", "pass@32") == [], "no run scored pass@k (--pass-at-k-size 0): no rows"

def run_in_process(jobs, workers, threads):
    """sweep.run_jobs without worker processes: each job's command (python -m MODULE ...) called in this one,
    the first whose needs are done first."""
    commands = {"lab.rl": rl.main, "lab.control": control.main}
    while not all(job["done"] for job in jobs):
        job = next(j for j in jobs if not j["done"] and all(dep["done"] for dep in j["after"]))
        commands[job["argv"][1]](job["argv"][2:])
        job["done"] = True
    return []

def test_a_tiny_sweep_runs_every_arm_of_every_seed_and_tabulates_its_runs(tmp_path, monkeypatch, capsys):
    """2 seeds x 3 arms end to end (the runs in this process): each arm's run in its own folder, the table's
    numbers from the runs' final.json by hand, and a second call that reads the runs, not running them."""
    monkeypatch.setattr(sweep, "run_jobs", run_in_process)
    flags = tiny_argv(tmp_path, "--sft-steps", "10", "--sft-eval-every", "10", "--val-size", "8",
                      "--rl-steps", "1", "--eval-size", "4")
    argv = ["--seeds", "0-1", "--arms", "sft-continued,bgpo,rft", "--final-eval-size", "12",
            "--pass-at-k-size", "3", *flags]
    rows = {row[0]: row for row in sweep.main(argv)}
    out = capsys.readouterr().out
    finals = {}
    for arm, seed in [(a, s) for a in ("bgpo", "rft", "sft-continued") for s in (0, 1)]:
        folder = sweep.run_folder(arm, seed, flags, 12)
        finals[arm, seed] = json.load(open(os.path.join(folder, "final.json")))
        assert folder in out and finals[arm, seed]["size"] == 12, (arm, seed)
        assert os.path.isfile(os.path.join(folder, "run.json"))
    assert len({sweep.run_folder(a, s, flags, 12) for a, s in finals}) == 6, "one folder per arm and seed"
    for arm in ("bgpo", "rft", "sft-continued"):
        a, b = finals[arm, 0]["accuracy"], finals[arm, 1]["accuracy"]
        assert rows[arm][2][0] == pytest.approx((a + b) / 2)
        assert rows[arm][2][1] == pytest.approx(12.706 * abs(a - b) / 2, rel=1e-4)
    sft = [finals["bgpo", s]["sft_accuracy"] for s in (0, 1)]
    assert [finals[arm, s]["sft_accuracy"] for arm in ("rft", "sft-continued") for s in (0, 1)] == sft * 2, (
        "every arm of a seed starts from the same SFT model")
    assert "pass@32 (%) at the rollout temperature on the first 3 of those" in out
    assert "0 of 8 jobs to run" in (sweep.main(argv) and capsys.readouterr().out), "finished runs are read"
    sweep.main([*argv, "--table-only", "--at-step", "1", "--at-step", "bgpo=1,rft=0"])
    out = capsys.readouterr().out
    assert "on 4 problems, the progress evaluation at RL step 1, mean" in out
    assert "on 4 problems, the progress evaluation at RL steps bgpo 1, rft 0, mean" in out
    logged = {(arm, s): {r["step"]: r["accuracy"] for r in read_log(os.path.join(
              sweep.run_folder(arm, s, flags, 12), "log.jsonl")) if "accuracy" in r}
              for arm in ("bgpo", "rft") for s in (0, 1)}
    jobs = sweep.plan(sweep.argparse.Namespace(seeds=[0, 1], arms=["bgpo", "rft"], final_eval_size=12,
                                               pass_at_k_size=3), flags)
    rows = {row[0]: row for row in sweep.table(sweep.at_step(sweep.curves(jobs), {"bgpo": 1, "rft": 0}),
                                                         "bgpo")}
    assert rows["bgpo"][2][0] == pytest.approx((logged["bgpo", 0][1] + logged["bgpo", 1][1]) / 2)
    minus_bgpo = [logged["rft", s][0] - logged["bgpo", s][1] for s in (0, 1)]
    assert rows["rft"][4][0] == pytest.approx(sum(minus_bgpo) / 2)
    assert rows["SFT model"][2][0] == pytest.approx((logged["rft", 0][0] + logged["rft", 1][0]) / 2)
    for (arm, seed), solves in {("bgpo", 0): [1, 0, 0, 0], ("bgpo", 1): [0, 0, 0, 0],   # as lab.reach --json
                                ("rft", 0): [1, 1, 0, 0], ("rft", 1): [1, 1, 1, 0]}.items():   # writes them
        with open(os.path.join(sweep.run_folder(arm, seed, flags, 12), "reach.json"), "w") as f:
            json.dump({"new_solves": solves}, f)
    sweep.main([*argv, "--table-only"])
    new_solves = capsys.readouterr().out.split("\nnew solves (%)")[1]
    assert " on 4 problems, mean" in new_solves.split("\n")[0]
    # shares by hand: bgpo 1/4, 0/4; rft 2/4, 3/4; rft minus bgpo 1/4, 3/4; half-widths 12.706 x |a - b| / 2
    assert re.search(r"\nbgpo +0,1 +12\.5 \[-146\.3, 171\.3\] +\+12\.5 \[", new_solves), new_solves
    assert re.search(r"\nrft +0,1 +62\.5 \[-96\.3, 221\.3\] +\+62\.5 \[-96\.3, \+221\.3\] +\+50\.0 "
                     r"\[-267\.7, \+367\.7\]", new_solves), new_solves   # minus the SFT model: its 0

def test_the_worker_pool_runs_jobs_after_those_they_need_and_skips_those_whose_needs_failed(tmp_path, capsys):
    marks = tmp_path / "order.txt"
    job = lambda name, code, after=(): {"name": name, "after": list(after), "done": False,
                                        "log": str(tmp_path / f"{name}.txt"),
                                        "argv": ["-c", f"open({str(marks)!r}, 'a').write('{name} '); "
                                                       f"raise SystemExit({code})"]}
    first = job("first", 0)
    broken = job("broken", 3)
    second, orphan = job("second", 0, [first]), job("orphan", 0, [broken])
    failed = sweep.run_jobs([second, orphan, first, broken], workers=1, threads=1)
    assert failed == ["broken", "orphan"] and marks.read_text() == "first second broken "
    assert "exit 3" in capsys.readouterr().out

@pytest.mark.parametrize("argv, message", [
    (["--arms", "bgpo,nope"], "unknown arm 'nope'"),
    (["--seeds", "3-x"], "--seeds must be like 0-4"),
    (["--seeds", "1,1"], "--seeds must be like 0-4"),
    (["--arms", "rft,sft-continued", "--reference", "rft"], "add bgpo to --arms"),
    (["--arms", "bgpo,rft", "--reference", "nt1"], "--reference nt1 is not one of --arms"),
    (["--arms", "bgpo,rft", "--at-step", "rft=100"], "names no step for the reference, bgpo"),
    (["--arms", "bgpo,rft", "--at-step", "bgpo=100,dyn=50"], "--at-step must be like 600 or bgpo=1200"),
    (["--arms", "bgpo,rft", "--at-step", "210"], "bgpo's step 210 is not an evaluation; the runs evaluate"),
    (["--arms", "bgpo,rft", "--at-step", "bgpo=400"], "bgpo's step 400 is not an evaluation"),
    (["--seeds", "4-0"], "--seeds must be like 0-4"),
    (["--run-n", "x"], "--run-name is the sweep's to set"),                    # an abbreviation too
    (["--neg-weight", "1", "--arms", "bgpo,neg-weight-1"], "two arms would write one folder"),
    (["--seed", "3"], "--seed is the sweep's to set"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_sweep_flag_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main([*argv, *CPU])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err

def test_the_sweep_figure_draws_each_arms_mean_and_its_paired_gain_with_their_intervals():
    arm_curves = {"bgpo": {0: {0: 0.10, 1: 0.20}, 25: {0: 0.16, 1: 0.30}}}
    left, right = (panel["lines"][0] for panel in sweep.sweep_figure(arm_curves)["panels"])
    assert left["x"] == [0, 25] and left["y"] == pytest.approx([15.0, 23.0])
    assert right["y"] == pytest.approx([0.0, 8.0])                           # gains 6 and 10 points
    # s = |6 - 10| / sqrt(2), half-width t_{0.975,1} s / sqrt(2) = 12.706 x 2
    assert right["band"][1][1] - 8.0 == pytest.approx(12.706 * 2, rel=1e-4)

def test_the_n_t_curve_takes_the_arms_that_differ_by_n_t_alone_and_places_each_at_its_n_t(tmp_path):
    arms = ["bgpo", "nt2", "rft", "nt4-p25", "nt16"]
    assert sweep.mc_samples_arms(arms, CPU) == {"bgpo": 8, "nt2": 2, "nt16": 16}  # nt4-p25: prompts differ
    assert sweep.mc_samples_arms(arms, [*CPU, "--mc-samples", "4"])["bgpo"] == 4   # bgpo's n_t: the flags'
    final = lambda accuracy, sft: {"accuracy": accuracy, "sft_accuracy": sft}
    finals = {"bgpo": {0: final(0.30, 0.10), 1: final(0.20, 0.12)},
              "nt2": {0: final(0.26, 0.10), 1: final(0.18, 0.12)},
              "nt16": {0: final(0.31, 0.10), 1: final(0.25, 0.12)}}
    # the costs from the runs' logs: medians over steps; a step without an update (activation 0) left out
    jobs = []
    for arm, seed in [(a, s) for a in finals for s in (0, 1)]:
        folder = tmp_path / f"{arm}{seed}"
        folder.mkdir()
        (folder / "final.json").write_text("{}")
        scale = {"nt2": 1, "bgpo": 4, "nt16": 8}[arm] * (1 + seed)
        (folder / "log.jsonl").write_text("".join(json.dumps(
            {"step": i, "seconds": 1 + 0.1 * scale * i, "rollout_seconds": 1, "activation_mb": mb}) + "\n"
            for i, mb in ((1, 5.0), (2, 0.0), (3, 7.0))))
        jobs.append({"arm": arm, "seed": seed, "folder": str(folder)})
    costs = sweep.step_costs(jobs)
    assert costs["nt2"][0] == pytest.approx({"update_s": 0.2, "activation_mb": 6.0})
    accuracy, sft, minus, update = (line for panel in sweep.nt_figure(finals, costs, {"bgpo": 8, "nt2": 2,
                                    "nt16": 16}, "bgpo")["panels"] for line in panel["lines"])
    assert accuracy["x"] == [2, 8, 16] and accuracy["y"] == pytest.approx([22.0, 25.0, 28.0])
    assert sft["y"] == pytest.approx([11.0] * 3)
    assert minus["y"] == pytest.approx([-3.0, 0.0, 3.0])          # nt2: -4 and -2; nt16: +1 and +5
    assert minus["band"][1][2] - 3.0 == pytest.approx(12.706 * 2, rel=1e-4)   # s = 4 / sqrt(2)
    assert update["y"] == pytest.approx([0.3, 1.2, 2.4])           # medians 0.2 and 0.4 for nt2, ...

def test_the_control_finds_the_rl_run_that_its_flags_name_lab_flags_included():
    for extra in (CPU, [*CPU, "--rl-lr", "2e-4"], [*CPU, "--temperature", "1.0", "--sft-steps", "30"]):
        expected = os.path.join("out", rl.parse_args(extra).run_name + "_sft-continued")
        assert sweep.run_folder("sft-continued", 0, extra, 2000) == expected, extra
    assert rl.parse_args([*CPU, "--rl-lr", "2e-4"]).run_name != rl.parse_args(CPU).run_name

# -----------------------------------------------------------------------------
# The final evaluation: pass@k and the entropy

def test_pass_at_k_equals_the_share_of_k_subsets_of_the_samples_that_hold_a_solve():
    """The unbiased estimator against brute force: every k-subset of n samples of which c solve."""
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert rl.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="pass_at_k"):
        rl.pass_at_k(4, 5, 2)

class FixedPredictions(torch.nn.Module):
    """A model whose prediction at completion position i is uniform over (i mod 3) + 2 tokens, whatever the
    input (MASK's logit -inf, as TinyDLLM's): entropy log 2, log 3, log 4, log 2, ..."""
    def __init__(self, vocab_size, mask_id, prompt_len):
        super().__init__()
        self.config = type("Config", (), {"mask_id": mask_id})
        self.vocab_size, self.prompt_len = vocab_size, prompt_len

    def forward(self, tokens):
        B, T = tokens.shape
        logits = torch.full((B, T, self.vocab_size), -30.0)
        for t in range(T):
            ids = [v for v in range(self.vocab_size) if v != self.config.mask_id]
            logits[:, t, ids[:(t - self.prompt_len) % 3 + 2]] = 0.0
        logits[..., self.config.mask_id] = -math.inf
        return logits

def test_the_policy_entropy_equals_its_value_by_hand():
    task = get_task("arithmetic")
    model = FixedPredictions(task.tokenizer.vocab_size, task.tokenizer.mask_id, task.prompt_len)
    expected = sum(math.log(i % 3 + 2) for i in range(task.gen_len)) / task.gen_len
    args = rl.parse_args(["--task", "arithmetic", "--device", "cpu"])
    prompts = task.sample(5, "test", 0)[0]
    assert rl.policy_entropy(model, task, prompts, args, batch_size=2) == pytest.approx(expected, abs=1e-6)

def test_evaluating_more_often_and_scoring_pass_at_k_leave_the_training_run_unchanged(tmp_path):
    """Evaluation draws no random number of training's: a run evaluated every step, scored for pass@k and
    tracking its SFT model's answers logs the same training numbers as one evaluated once, without them.
    The tracked answers' likelihoods at step 0 are lab.negatives' exact measures of the SFT model's."""
    often = tiny_argv(tmp_path, "--eval-every", "1", "--final-eval-size", "8", "--pass-at-k-size", "4",
                      "--track-answers", "1")
    rarely = tiny_argv(tmp_path, "--eval-every", "2")
    logs = []
    for argv in (often, rarely):
        rl.main(argv)
        logs.append(read_log(os.path.join(tmp_path, rl.parse_args(argv).run_name, "log.jsonl")))
    final = json.load(open(os.path.join(tmp_path, rl.parse_args(often).run_name, "final.json")))
    assert final["pass_at_k_size"] == 4 and set(final["pass_at_k"]) == {str(k) for k in rl.PASS_K}
    assert "eval_entropy" in logs[0][1] and "eval_entropy" not in logs[1][1]
    args, task = rl.parse_args(often), get_task("arithmetic")
    tracked = rl.tracked_answers(rl.sft_model(args, task), task, args, args.track_answers)
    with torch.no_grad():
        exact = negatives.exact_measures(rl.sft_model(args, task), tracked.x, tracked.y)
    for kind, rows in (("wrong", tracked.rewards < 1), ("right", tracked.rewards == 1)):
        expected = exact["log_likelihood"][rows].mean().item() / task.gen_len if rows.any() else None
        assert logs[0][0][f"track_{kind}_log_pi"] == pytest.approx(expected, abs=1e-9)
        assert all(f"track_{kind}_log_pi" in record for record in logs[0])
    timing = {"seconds", "rollout_seconds", "hint_seconds", "update_seconds"}
    for a, b in zip(*logs):
        assert {k: a[k] for k in b if k not in timing} == {k: v for k, v in b.items() if k not in timing}

def test_sft_stopped_at_a_step_is_the_model_that_bgpo_py_s_sft_run_had_at_that_step(tmp_path):
    """lab.rl --sft-stop N against bgpo.run_sft: the model bgpo.py kept (its best validated step, s) is the
    model that the lab's copy of its steps has after s steps."""
    argv = tiny_argv(tmp_path, "--sft-steps", "30", "--sft-eval-every", "10")
    bgpo.main(argv + ["--stage", "sft"])
    kept = torch.load(bgpo.sft_path(bgpo.parse_args(argv)), weights_only=True)
    args = rl.parse_args(argv + ["--sft-stop", str(kept["step"]), "--stage", "sft"])
    model = rl.sft_model(args, get_task("arithmetic"))
    assert rl.sft_path(args).endswith(f"_stop{kept['step']}.pt") and os.path.isfile(rl.sft_path(args))
    for name, value in model.state_dict().items():
        assert torch.equal(value, kept["model"][name]), name
    with pytest.raises(SystemExit):
        rl.parse_args(argv + ["--sft-stop", "31"])
