"""
The lab's commands run end to end on tiny models: python -m lab.rl with every objective and option,
the estimator lab, the memory table, the comparison figure; bad flags exit 2 with one line.
"""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import bgpo
from lab import (bench_estimators, bench_memory, bench_step, capped, cli, compare, control, dtrpo_offline,
                 entropy_mechanism, figures, gpu_report, graphs, negatives, objectives, offpolicy, phases,
                 reach, readme_figure, rl, sampler, stages)
from lab import simulated_cuda
from lab.testing import needs_real_cuda, tiny_argv
from tasks import get_task
from tiny_dllm import generate

@pytest.fixture(scope="module")
def shared_out(tmp_path_factory):
    return tmp_path_factory.mktemp("field")

@pytest.mark.parametrize("objective, extra", [("diffu-grpo", ["--advantages", "no-std"]),
                                              ("stp", ["--stp-tau", "0.5"]),
                                              ("dtrpo", []), ("spg", [])])
def test_two_rl_steps_run_for_each_field_objective(shared_out, objective, extra):
    tmp_path = shared_out                                                  # one SFT model for the three runs
    # they only need to run
    history = rl.main(tiny_argv(tmp_path, "--objective", objective, "--sft-steps", "30", *extra))
    assert [h["step"] for h in history] == [0, 1, 2]
    name = rl.parse_args(tiny_argv(tmp_path, "--objective", objective, "--sft-steps", "30", *extra)).run_name
    run = {"diffu-grpo": "diffu-grpo_no-std_u4", "stp": "stp_nt4_tau0.5_u4", "dtrpo": "dtrpo_u4",
           "spg": "spg_nt4"}[objective]
    assert name.startswith(f"arithmetic_{run}_seed0_"), name     # and a hash of the tiny sizes
    records = figures.read_log(tmp_path / name / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    passes = [r["rollout_passes"] for r in records[1:]]
    assert passes == ([3, 3] if objective == "stp" else [4, 4]), (
        "STP: 2 of 4 tokens, then one pass fills the rest")

def test_naive_two_pass_runs_make_the_naive_runs_updates_and_the_lemma_ablation_runs(shared_out,
                                                                                     monkeypatch):
    """python -m lab.rl --minibatches 2 with each objective of the lemma ablation: the two-pass naive run
    ends at the one-graph naive run's weights (float64), each lemma alone somewhere else."""
    fixed = lambda rewards, G: torch.linspace(-1, 1, len(rewards))
    monkeypatch.setitem(objectives.ADVANTAGES, "group", fixed)
    weights = {}
    for objective in ("naive", "naive-two-pass", "lemma1-only", "lemma2-only", "bgpo"):
        argv = tiny_argv(shared_out, "--objective", objective, "--sft-steps", "30", "--minibatches", "2",
                         "--rl-lr", "1e-2")
        rl.main(argv)
        path = shared_out / rl.parse_args(argv).run_name / "ckpt.pt"
        state = torch.load(path, weights_only=True)["model"]
        weights[objective] = torch.cat([w.flatten() for w in state.values()])
    gap = {name: (w - weights["naive"]).abs().max().item() for name, w in weights.items()}
    assert gap["naive-two-pass"] < 1e-10, gap
    assert min(gap["lemma1-only"], gap["lemma2-only"], gap["bgpo"]) > 1e-6, gap

def test_offpolicy_measures_the_second_minibatch_where_the_two_pass_gradient_is_the_naive_one(tmp_path,
                                                                                             monkeypatch):
    """From the checkpoint of the RL run its flags name (as python -m lab.rl names it; with none: the default
    run's, which bgpo.py's is too), and from its SFT model with a fresh AdamW."""
    monkeypatch.setattr(offpolicy, "group_advantages", lambda rewards, G: torch.linspace(-1, 1, len(rewards)))
    rl.main(tiny_argv(tmp_path, "--sft-steps", "30"))
    run = rl.parse_args(tiny_argv(tmp_path, "--sft-steps", "30")).run_name   # --rl-lr names another run
    for start in ([], ["--from-sft"]):
        results = offpolicy.main(tiny_argv(tmp_path, "--sft-steps", "30", *start, "--batches", "2",
                                           "--rl-lr", "1e-2", "--run-name", run))
        assert len(results) == 2
        for r in results:
            assert r["max |d|"] > 1e-4 and r["naive (two passes)"][0] < 1e-10, (start, r)
            assert r["BGPO"][0] > 1e-6 and r["BGPO"][1] < 1 - 1e-12, (start, r)

def test_the_trajectory_control_runs_from_the_cli_and_logs_what_the_rollouts_are(tmp_path):
    argv = tiny_argv(tmp_path, "--objective", "trajectory", "--remasking", "random", "--neg-weight", "0.5")
    rl.main(argv)
    records = figures.read_log(tmp_path / rl.parse_args(argv).run_name / "log.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert 0 <= r["valid"] <= 1 and 0 <= r["solved"] <= 1 and r["entropy"] > 0 and r["grad_pos"] >= 0

def test_rl_pool_practises_only_on_its_problems_and_reports_their_accuracy(tmp_path, monkeypatch):
    real, rollout_prompts = sampler.encode, []

    def recording_encode(task, prompts, answers=None, device="cpu"):
        if len(prompts) == 2 * 4:                                        # prompts-per-step x group-size
            rollout_prompts.extend(prompts)
        return real(task, prompts, answers, device)

    monkeypatch.setattr(sampler, "encode", recording_encode)
    argv = tiny_argv(tmp_path, "--rl-pool", "3", "--rl-steps", "3", "--eval-size", "5")
    rl.main(argv)
    pool, _ = get_task("arithmetic").sample(3, "train", 0 + 2)           # seed + 2, as run_rl draws it
    assert len(rollout_prompts) == 3 * 8 and set(rollout_prompts) <= set(pool)
    records = figures.read_log(tmp_path / rl.parse_args(argv).run_name / "log.jsonl")
    assert [r["step"] for r in records if "pool_accuracy" in r] == [0, 1, 2, 3]     # with every evaluation
    assert all(0.0 <= r["pool_accuracy"] <= 1.0 for r in records if "pool_accuracy" in r)

def test_compare_draws_the_runs_named_and_a_missing_one_exits_2(tmp_path, capsys):
    bgpo.main(tiny_argv(tmp_path, "--rl-steps", "1"))
    run = bgpo.parse_args(tiny_argv(tmp_path, "--rl-steps", "1")).run_name
    compare.main([run, "--out-dir", str(tmp_path)])
    assert "compare.png" in capsys.readouterr().out
    for runs in ([f"mean={run},no_such_run"], ["no_such_run"]):
        with pytest.raises(SystemExit) as e:
            compare.main(runs + ["--out-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "no log.jsonl" in err and "no_such_run" in err and err.count("\n") == 1

def test_mean_of_runs_averages_each_step_over_the_runs_that_have_it():
    a = [{"step": 0, "accuracy": 0.2}, {"step": 1, "reward": 0.5},
         {"step": 2, "reward": 0.1, "accuracy": 0.4}]
    b = [{"step": 0, "accuracy": 0.4}, {"step": 1, "reward": 0.3}, {"step": 2, "reward": 0.3}]
    assert compare.mean_of_runs([a, b]) == [{"step": 0, "accuracy": pytest.approx(0.3)},
                                            {"step": 1, "reward": pytest.approx(0.4)},
                                            {"step": 2, "reward": pytest.approx(0.2)}]

def test_bench_estimators_runs_from_the_command_line_and_its_exact_columns_agree(tmp_path, monkeypatch):
    # one row: the pipeline, not the numbers
    monkeypatch.setattr(bench_estimators, "N_T", (1,))
    monkeypatch.setattr(bench_estimators, "REPEATS", 2)
    monkeypatch.setattr(bench_estimators, "lab_batch", lambda task: (3, 2))
    # d1's 2^12 prompt masks: tested elsewhere
    monkeypatch.setattr(bench_estimators, "MAX_PROMPT_MASKED", 0)
    bench_estimators.main(tiny_argv(tmp_path, "--task", "countdown", "--sft-steps", "20"))  # SFT first
    result = json.loads((tmp_path / "estimators_countdown.json").read_text())
    rows = result["likelihood"]
    for name in ("ELBO, stratified (BGPO)", "antithetic pair (ours)"):          # unbiased: exactly the ELBO
        assert np.allclose(rows[name]["mean"], result["elbo"], atol=1e-5), name
    assert np.allclose(rows["dTRPO, 1 step per block"]["mean"], rows["trajectory, all steps"]["mean"],
                       atol=1e-5)
    assert result["gradient"]["BGPO = naive (ELBO)"]["own_vs_elbo"] == 0.0
    assert [row["n_t"] for row in result["signal_to_noise"]] == [1, "inf"]

def test_curves_figure_holds_the_lines_it_draws_and_draws_a_png_when_matplotlib_is_there(tmp_path):
    records = [{"step": 0, "accuracy": 0.25, "eval_reward": 0.3}] + \
        [{"step": s, "reward": float(s), **({"accuracy": 0.5} if s == 3 else {})} for s in (1, 2, 3)]
    figure = figures.curves_figure({"run": records, "other run": records})
    reward, accuracy = (panel["lines"][0] for panel in figure["panels"])
    assert reward["x"] == [1, 2, 3] and reward["y"] == [1.0, 1.5, 2.0], "running mean of the rewards"
    assert [len(panel["lines"]) for panel in figure["panels"]] == [2, 2], "a line per run"
    each_step = figures.curves_figure({"run": records})["panels"][0]["lines"][0]
    assert each_step["y"] == [1.0, 2.0, 3.0], "a single run also shows each step's reward"
    assert accuracy["x"] == [0, 3] and accuracy["y"] == [0.25, 0.5]
    pytest.importorskip("matplotlib")
    assert os.path.getsize(figures.draw(figure, str(tmp_path / "f.png"))) > 1000

def test_memory_table_bgpo_is_flat_in_n_t_and_the_batched_estimators_grow(tmp_path):
    args = bench_memory.parse_args(tiny_argv(tmp_path, "--bench-repeats", "1"))
    rows = {(r["objective"], r["samples"]): r["act_mb"]
            for r in bench_memory.every_objective_table(args, get_task("arithmetic"))}
    assert rows["bgpo", 16] <= 1.1 * rows["bgpo", 1], "BGPO: one sample's graph at a time"
    assert all(rows[name, 16] > 8 * rows[name, 1] for name in ("naive", "stp", "spg")), (
        "one batch of n copies")

def test_the_step_benchmarks_flop_count_is_the_tokens_its_step_passes_through_the_model(tmp_path):
    """bench_step's FLOPs (nanoGPT's count, from the sizes) against one step's forward passes as the model
    sees them: the rows and tokens of every call, with and without grad, times a token's cost by hand."""
    args = bgpo.parse_args(tiny_argv(tmp_path, "--mc-chunk", "2", "--prompts-per-step", "4"))
    task, calls = get_task("arithmetic"), []
    torch.manual_seed(0)
    model = bgpo.make_model(task, args)
    model.register_forward_hook(lambda m, inputs, out: calls.append((torch.is_grad_enabled(),
                                                                     inputs[0].numel())))
    optimizer = torch.optim.AdamW(model.parameters())
    generator = torch.Generator().manual_seed(0)
    C, layers, T = 16, 1, task.prompt_len + task.gen_len
    N = sum(p.numel() for name, p in model.named_parameters() if name != "pos_emb.weight")
    forward = 2 * N + 4 * layers * T * C
    # every row updated; then 1 of the 4 groups mixed, whose 4 rows alone --skip-tied (the CPU size's) keeps
    for mixed, updated, rows in [(1.0, None, 16), (0.25, bench_step.updated_rows(args, 0.25), 4)]:
        calls.clear()
        bench_step.rl_step(model, optimizer, task, args, generator, generator, meter=True, mixed=mixed)
        tokens = {grad: sum(n for g, n in calls if g == grad) for grad in (False, True)}
        assert [g for g, _ in calls] == [False] * task.gen_len + [True] * 2   # the sampler's L; n_t 4 in 2
        assert tokens[True] == rows * 4 * T and updated in (None, rows)
        flops = (tokens[False] + 3 * tokens[True]) * forward
        assert bench_step.step_flops(model, task, args, updated) == flops

def test_the_step_benchmark_times_both_paths_and_a_bad_flag_exits_2(tmp_path, capsys):
    rows = bench_step.main(tiny_argv(tmp_path, "--steps", "1", "--warmup", "0", "--peak-tflops", "1",
                                     "--profile"))
    out = capsys.readouterr().out
    # the profile's sum over ATen ops against the step's wall time: the host's ops fit inside the step
    wall, host = map(float, re.search(r"([\d.]+) ms wall, the host ([\d.]+) ms in ATen ops", out).groups())
    assert 0 < host <= wall and "longest on the host: " in out, out
    assert set(rows) == {"float32", "bgpo.py"} and all(r["s"] > 0 and 0 < r["mfu"] < 1 for r in rows.values())
    assert rows["float32"]["act_mb"] == rows["bgpo.py"]["act_mb"] > 0   # the CPU: one path, metered
    assert "| float32, random numbers drawn on the CPU" in out and "| bgpo.py: float32" in out, out
    for bad, message in [(["--steps", "0"], "--steps must be at least 1"),
                         (["--size", "tpu"], "invalid choice"),
                         (["--cap-gib", "-3"], "--cap-gib must be positive"),
                         (["--peak-tflops", "0"], "--peak-tflops must be positive"),
                         (["--graphs"], "--graphs needs a CUDA device")]:
        with pytest.raises(SystemExit) as e:
            bench_step.main(tiny_argv(tmp_path, *bad))
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, err

def test_the_sync_count_says_when_the_host_waits_for_the_device():
    """bench_step.waits, by hand: a meta tensor stands in for a GPU's (its device is not the host's; the
    op is classified, never run)."""
    aten, gpu, host = torch.ops.aten, torch.empty(4, device="meta"), torch.empty(4)
    cases = [(aten._local_scalar_dense.default, (gpu,), {}, True),       # .item(), float(), if tensor:
             (aten._local_scalar_dense.default, (host,), {}, False),
             (aten.nonzero.default, (gpu,), {}, True),                   # the shape is a value
             (aten.index.Tensor, (gpu, [gpu > 0]), {}, True),            # x[mask]
             (aten.index.Tensor, (gpu, [gpu.long()]), {}, False),         # x[indices on the device]
             (aten.index.Tensor, (gpu, [host.long()]), {}, True),         # x[indices on the host]: copied
             (aten.index.Tensor, (host, [host.long()]), {}, False),
             (aten.equal.default, (gpu, gpu), {}, True),                  # reads its answer inside
             (aten._to_copy.default, (gpu,), {"device": torch.device("cpu")}, True),        # y.cpu()
             (aten._to_copy.default, (host,), {"device": torch.device("meta")}, True),      # a.to(device)
             (aten._to_copy.default, (host,), {"device": torch.device("meta"), "non_blocking": True}, False),
             (aten._to_copy.default, (gpu,), {"dtype": torch.float16}, False),
             (aten.copy_.default, (gpu, host), {}, True), (aten.copy_.default, (gpu, host, True), {}, False),
             (aten.copy_.default, (gpu, gpu), {}, False), (aten.add.Tensor, (gpu, gpu), {}, False)]
    for func, args, kwargs, expected in cases:
        assert bench_step.waits(func, args, kwargs) == expected, (func, kwargs)

@pytest.mark.parametrize("skip_tied, minibatches", [(True, 1), (False, 1), (True, 2)])
def test_an_updates_rows_reach_the_device_without_a_wait(skip_tied, minibatches):
    """bgpo.rows_to_update, the RL step's data movement: with the rollouts, masked copies and old terms on a
    stand-in for a GPU (meta) and the advantages on the host, as run_rl has them, no op makes the host wait
    (before: five a mini-batch, the advantages' copy and four gathers by a host index). On the CPU, the rows
    and advantages it returns against the mini-batch's by hand: its rows with signal (all without
    --skip-tied), the advantages times kept / rows."""
    B, M, L, P = 8, 3, 5, 4
    A = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5, -0.5, -0.5, -0.5])   # group 1 ties (A = 0), group 2 does not
    old_terms = torch.randn(B, M) if minibatches > 1 else None
    on_cpu = (torch.arange(B * P).view(B, P), torch.arange(B * L).view(B, L),
              bgpo.draw_mc_samples(B, L, M, torch.Generator().manual_seed(0)), old_terms)
    for rows in torch.arange(B).chunk(minibatches):
        args = bgpo.parse_args(tiny_argv("unused", *([] if skip_tied else ["--no-skip-tied"])))
        signal, (x, y, mc, old, A_kept) = bgpo.rows_to_update(rows, A, *on_cpu, args)
        kept = [i for i in rows.tolist() if A[i] != 0 or not skip_tied]
        assert signal == sum(A[i] != 0 for i in rows.tolist()) and x.tolist() == on_cpu[0][kept].tolist()
        assert torch.equal(y, on_cpu[1][kept]) and torch.equal(mc.mask, on_cpu[2].mask[kept])
        assert torch.equal(mc.weight, on_cpu[2].weight[kept]) and (old is None) == (old_terms is None)
        assert old is None or torch.equal(old, old_terms[kept])
        assert torch.allclose(A_kept, A[kept] * len(kept) / len(rows))
        args.device = "meta"
        on_gpu = [t.to("meta") for t in on_cpu[:2]] + [on_cpu[2].to("meta")] \
            + [None if old_terms is None else old_terms.to("meta")]
        with bench_step.OpCounter() as ops:
            meta = bgpo.rows_to_update(rows, A, *on_gpu, args)[1]
        assert all(t is None or t.device.type == "meta" for t in meta[:2] + meta[3:]), meta
        assert sum(ops.syncs.values()) == 0, ops.syncs

def test_the_graphed_sampler_refuses_a_generator_off_the_gpu():
    model = bgpo.make_model(get_task("arithmetic"), bgpo.parse_args(tiny_argv("unused")))
    with pytest.raises(ValueError, match="generator: a CUDA graph draws on the GPU"):
        graphs.GraphedSampler(model, 5, 1.3, torch.Generator())

@needs_real_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_graphed_sampler_draws_what_the_eager_sampler_draws(tmp_path):
    """Replays of the captured sampler against eager calls with a twin generator, bit for bit, three times,
    with the weights moved in place between calls as the optimizer moves them: one capture, the same
    completions, the generators in the same state after."""
    args = bgpo.parse_args(tiny_argv(tmp_path, "--device", "cuda", "--task", "countdown"))
    task = get_task("countdown")
    torch.manual_seed(0)
    model = bgpo.make_model(task, args)
    x = bgpo.encode(task, task.sample(16, "train", 0)[0], device=args.device)
    graphed, eager = (torch.Generator(args.device).manual_seed(5) for _ in range(2))
    sampler = graphs.GraphedSampler(model, task.gen_len, bgpo.TEMPERATURE, graphed, args.dtype)
    for _ in range(3):
        with bgpo.autocast(args):
            expected = generate(model, x, task.gen_len, temperature=bgpo.TEMPERATURE, generator=eager)
        assert torch.equal(sampler(x), expected)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
    assert sampler.captures == 1 and torch.equal(graphed.get_state(), eager.get_state())

def test_capped_answers_help_and_refuses_a_missing_script_or_a_bad_cap_in_one_line(tmp_path, capsys):
    """python -m lab.capped GIB SCRIPT: a script that is not there, or a cap that is not a positive number,
    exits 2 with one line (it used to end in a FileNotFoundError traceback)."""
    for argv, message in [(["24", str(tmp_path / "missing.py")], "no script"), (["-3", "bgpo.py"], "GIB > 0"),
                          (["24"], "usage"), (["x", "bgpo.py"], "usage")]:
        with pytest.raises(SystemExit) as e:
            capped.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)
    with pytest.raises(SystemExit) as e:   # --help: its usage, exit code 0
        capped.main(["--help"])
    assert e.value.code == 0 and "python -m lab.capped 24 bgpo.py" in capsys.readouterr().out

def test_the_memory_cap_names_the_gpu_by_its_index(monkeypatch):
    """torch.cuda.set_per_process_memory_fraction wants a device index and refused the bare "cuda" that
    bench_step passed it (a ValueError on every GPU). On the CPU, with fakes of the CUDA calls and PyTorch's
    check of the device argument: the fraction and the index that lab.capped.cap_memory passes."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: calls.append(
        (fraction, torch.cuda._utils._get_device_index(device))))   # PyTorch's check: it raises for "cuda"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=96 << 30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        torch.cuda.set_per_process_memory_fraction(0.25, "cuda")       # the fake refuses it, as PyTorch does
    for device, gib in [("cuda", 24), ("cuda:1", 24), ("cuda", 200)]:
        capped.cap_memory(device, gib)
    assert calls == [(0.25, 0), (0.25, 1), (1.0, 0)], calls

DRY_RUN = {name: (log, argv) for _, log, name, argv in gpu_report.commands("RUNS", dry_run=True)}

@pytest.mark.parametrize("name, shown", [
    ("bench_step", ["| ops: sampler update optim. other  total | syncs: sampler update optim. other | path",
                    "profile of one bgpo.py step"]),
    ("countdown", ["test accuracy 0.0% -> "]),
    ("bench-memory", [" n_t | naive MiB BGPO MiB"]),
    ("torchrun", ["(torchrun_first_steps: "])])
@needs_real_cuda   # lab.capped caps a card's memory where PyTorch sees one
def test_each_command_of_the_gpu_reports_dry_run_runs_on_the_cpu(name, shown, tmp_path, monkeypatch, capsys):
    """python -m lab.gpu_report --dry-run runs, side by side on the CPU, each kind of command a GPU session
    runs, with tiny flags, so that the GPU's one command cannot rot between the sessions lent a GPU. Here each
    command's own argv runs in this process (a Python process each would take longer than the test may): it
    ends without error, and the lines the report keeps from its output hold its result. torchrun's
    one process runs bgpo.py as one process does, in torchrun's environment; the launcher itself is
    test_bgpo.py's test of two processes."""
    _, argv = DRY_RUN[name]
    argv = [str(tmp_path) if a == "RUNS" else a for a in argv]
    assert argv[:2] == [sys.executable, "-m"], argv
    module, args = argv[2], argv[3:]
    if module == "torch.distributed.run":
        assert args[:2] == ["--standalone", "--nproc_per_node=1"], args
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
            monkeypatch.setenv(key, value)
        module, args = "lab.capped", ["24"] + args[2:]          # bgpo.py and its flags, as the launcher runs
    monkeypatch.chdir(gpu_report.ROOT)                            # where the report runs its commands
    try:
        {"lab.bench_step": bench_step.main, "lab.capped": capped.main}[module](args)
    except SystemExit as end:                                     # bgpo.py ends with sys.exit(its code)
        assert end.code in (0, None), end.code
    out = capsys.readouterr().out
    kept = "\n".join(gpu_report.result_lines(out))
    for line in shown:
        assert line in kept, (line, kept)

def test_the_gpu_report_runs_its_commands_and_reports_each_from_its_own_log(tmp_path, monkeypatch):
    """gpu_report.main with stand-in commands, quick Python lines that print a result line each: phase 1
    alone and in order, phase 2 side by side, two commands in one log after each other. The report gives
    each command's exit code and its own result lines, not those of the command before it in its log, in
    at most 8 files."""
    say = lambda text, code=0: [sys.executable, "-c", f"print({text!r}); raise SystemExit({code})"]
    planned = [(1, "bench.log", "bench_step", say("profile of one bgpo.py step")),
               (1, "countdown.log", "countdown", say("test accuracy 0.0% -> 12.5%")),
               (2, "memory.log", "bench-memory", say(" n_t | naive MiB BGPO MiB")),
               (2, "memory.log", "torchrun", say("(torchrun_first_steps: 3 s on cpu)", 1)),
               (2, "pytest.log", "pytest", say("3 passed in 0.1s"))]
    monkeypatch.setattr(gpu_report, "commands", lambda runs_dir, dry_run: planned)
    done = gpu_report.main(["--dry-run", "--out", str(tmp_path)])
    assert [(name, code) for name, _, _, code, _, _ in done] == [
        ("bench_step", 0), ("countdown", 0), ("bench-memory", 0), ("torchrun", 1), ("pytest", 0)]
    assert done[0][5] <= done[1][4], "phase 1: one command after the other"
    report = (tmp_path / "report.md").read_text()
    for shown in ("## torchrun: exit code 1", "test accuracy 0.0% -> 12.5%", "3 passed in 0.1s",
                  "Every command ran side by side (a dry run)."):
        assert shown in report, (shown, report)
    memory_table = report[report.index("## bench-memory"):report.index("## torchrun")]
    assert " n_t | naive MiB" in memory_table and "torchrun_first_steps" not in memory_table, memory_table
    assert len(os.listdir(tmp_path)) <= 8, os.listdir(tmp_path)

def test_the_gpu_report_reads_each_command_its_own_part_of_a_shared_log():
    """bench.log holds bench_step's table and then the same command with --compile: each gets its own, though
    the first command's line begins the second's."""
    first, second = ["python", "-m", "lab.bench_step"], ["python", "-m", "lab.bench_step", "--compile"]
    log = "$ python -m lab.bench_step\n0.0586 3.15x\n$ python -m lab.bench_step --compile\n0.0628 3.00x\n"
    assert gpu_report.own_part(log, first) == "$ python -m lab.bench_step\n0.0586 3.15x"
    assert gpu_report.own_part(log, second) == "$ python -m lab.bench_step --compile\n0.0628 3.00x\n"

def test_memory_figure_holds_the_lines_it_draws():
    measured = lambda mb, s: {"mb": mb, "s": s, "cuda_mb": None}
    rows = [{"n_t": n, "naive": measured(10.0 * n, 1.0), "bgpo": measured(10.0, 0.5)} for n in (1, 2)]
    rows.append({"n_t": 4, "naive": None, "bgpo": measured(10.0, 0.5)})      # naive out of memory: not drawn
    memory, ratio = bench_memory.memory_figure(rows)["panels"]
    assert ([line["y"] for line in memory["lines"]] == [[10.0, 20.0], [10.0, 10.0]]
            and ratio["lines"][0]["y"] == [0.5, 0.5])

def test_offline_dtrpo_needs_solved_and_unsolved_pairs_and_says_so_in_one_line(tmp_path, capsys):
    """An SFT model of 10 steps solves no addition: no pair for DPO, one line, exit code 2."""
    with pytest.raises(SystemExit) as e:
        cli.command_line(
            lambda: dtrpo_offline.main(tiny_argv(tmp_path, "--eval-size", "4", "--sft-steps", "10")),
            "lab.dtrpo_offline")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "give no solved/unsolved pair" in err and err.count("\n") == 1, err

def test_stages_figure_starts_rl_and_the_control_where_sft_kept_its_model(tmp_path):
    sft = [{"step": s, "seconds": 10.0 * s, "val_reward": v, "val_accuracy": v / 2}
           for s, v in ((1, 0.1), (2, 0.3), (3, 0.3), (4, 0.2))]  # kept: step 2, the first best, at 20 s
    rl_log = [{"step": 0, "accuracy": 0.15}, {"step": 1, "reward": 0.1, "seconds": 4.0},
              {"step": 2, "reward": 0.2, "seconds": 6.0, "accuracy": 0.25}]
    control = [{"step": 2, "seconds": 0.0, "accuracy": 0.15}, {"step": 9, "seconds": 10.5, "accuracy": 0.05}]
    figure = figures.stages_figure(sft, rl_log, control)
    sft_val, rl_line, control_line = figure["panels"][0]["lines"]
    assert sft_val["x"] == [10.0, 20.0, 30.0, 40.0] and sft_val["y"] == [0.05, 0.15, 0.15, 0.1]
    assert rl_line["x"] == [20.0, 30.0] and rl_line["y"] == [0.15, 0.25], (
        "RL's evaluations at its training seconds after SFT's")
    assert control_line["x"] == [20.0, 30.5] and "step 2" in rl_line["label"]
    with pytest.raises(SystemExit):
        stages.main(tiny_argv(tmp_path, "--run-name", "nothing-here"))
    pytest.importorskip("matplotlib")
    rl.main(tiny_argv(tmp_path, "--rl-steps", "1"))
    assert os.path.getsize(stages.main(tiny_argv(tmp_path, "--rl-steps", "1"))) > 1000

def test_control_continues_sft_for_the_training_time_of_the_rl_run(tmp_path, capsys):
    rl.main(tiny_argv(tmp_path))
    run = tmp_path / rl.parse_args(tiny_argv(tmp_path)).run_name
    rl_log = figures.read_log(run / "log.jsonl")
    curve = control.main(tiny_argv(tmp_path))
    assert figures.read_log(str(run) + "_sft-continued/log.jsonl") == curve
    assert [c["step"] for c in curve] == [r["step"] for r in rl_log if "accuracy" in r], (
        "the control evaluates where the RL run did, at the same training seconds")
    assert curve[0]["accuracy"] == rl_log[0]["accuracy"], (
        "the control starts from the SFT model RL started from")
    assert (curve[-1]["seconds"] >= sum(r.get("seconds", 0) for r in rl_log)
            and curve[-1]["step"] > curve[0]["step"])
    with pytest.raises(SystemExit) as e:
        control.main(tiny_argv(tmp_path, "--run-name", "nothing-here"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no RL log" in err and err.count("\n") == 1, err

@pytest.mark.parametrize("command", [rl, bench_estimators, bench_memory, compare, control, dtrpo_offline,
                                     entropy_mechanism, negatives, offpolicy, reach, stages])
def test_every_lab_command_lists_its_flags_with_defaults(command, capsys):
    with pytest.raises(SystemExit) as e:
        command.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--out-dir" in out and "(default:" in out
    assert command is compare or "evaluation is greedy (default: 1.3)" in " ".join(out.split()), (
        "the lab's flags, with bgpo.py's constants as defaults")

@pytest.mark.parametrize("command", [rl, bench_estimators, bench_memory, compare, control, dtrpo_offline,
                                     entropy_mechanism, negatives, offpolicy, reach, stages])
@pytest.mark.parametrize("extra", [["--temperature", "-1"], ["--sft-lr", "1e-3"], ["--rl-steps", "0"]])
def test_every_lab_command_refuses_a_bad_flag_in_one_line(tmp_path, capsys, command, extra):
    """--sft-lr is no flag (SFT is bgpo.py's, with its constants); bgpo.check_args refuses --rl-steps 0."""
    argv = ["some_run", *extra] if command is compare else tiny_argv(tmp_path, *extra)
    with pytest.raises(SystemExit) as e:
        command.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error:" in err, err

@pytest.mark.parametrize("extra, message", [
    (["--neg-weight", "1.5"], "--neg-weight must be in [0, 1]"),
    (["--objective", "trajectory", "--updates-per-batch", "2"], "on-policy"),
    (["--objective", "trajectory", "--minibatches", "2"], "on-policy"),
    (["--objective", "spg", "--updates-per-batch", "2"], "on-policy"),
    (["--spg-mix", "0.5"], "--spg-mix is an option of --objective spg, not bgpo"),
    (["--objective", "spg", "--spg-beta", "0"], "--spg-beta must be positive"),
    (["--stp-tau", "0.5"], "--stp-tau is an option of --objective stp, not bgpo"),
    (["--objective", "naive", "--cov-detach", "0.1"], "--cov-detach is an option of --objective bgpo"),
    (["--entropy-coef", "0.1", "--mc-chunk", "2"], "--entropy-coef runs one masked copy per backward"),
    (["--cov-detach", "1"], "--cov-detach must be in (-1, 1), got 1.0"),
    (["--cov-detach", "-1"], "--cov-detach must be in (-1, 1), got -1.0"),
    (["--entropy-coef", "-0.1"], "--entropy-coef must be >= 0, got -0.1"),
    (["--objective", "stp", "--stp-tau", "0"], "--stp-tau must be in (0, 1]"),
    (["--objective", "dtrpo", "--no-anchors"], "--no-anchors is an option of --objective stp"),
    (["--objective", "diffu-grpo", "--mc-chunk", "2"], "--mc-chunk is an option of --objective bgpo"),
    (["--rl-pool", "1"], "smaller than --prompts-per-step"),
    (["--rl-pool", "-1"], "integer >= 0"),
    (["--objective", "ppo"], "invalid choice"),
    (["--remasking", "left"], "invalid choice"),
    (["--minibatches", "3"], "--minibatches 3 must divide --prompts-per-step 2"),
    (["--objective", "naive-two-pass", "--mc-chunk", "2"], "--mc-chunk is an option of --objective bgpo"),
    (["--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--rl-lr", "0"], "--rl-lr must be positive"),
    (["--clip-eps", "-1"], "--clip-eps must be positive"),
    (["--rl-warmup", "-1"], "--rl-warmup must be an integer >= 0"),
    (["--updates-per-batch", "0"], "--updates-per-batch must be a positive integer"),
    (["--block-len", "5"], "--block-len must be in 1..4"),
    (["--block-len", "2", "--gen-steps", "1"], "--gen-steps must be in 2..4"),
    (["--bench-repeats", "0"], "--bench-repeats must be a positive integer"),
    (["--mc-samples", "0"], "--mc-samples must be at least 1"),
    (["--size", "gpu"], "--size gpu, --dtype bfloat16 and --no-skip-tied are bgpo.py's: the lab runs"),
    (["--dtype", "bfloat16"], "--size gpu, --dtype bfloat16 and --no-skip-tied are bgpo.py's"),
    (["--no-skip-tied"], "--size gpu, --dtype bfloat16 and --no-skip-tied are bgpo.py's"),
])
def test_bad_lab_rl_flags_exit_2_with_one_line(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        rl.parse_args(tiny_argv(tmp_path, *extra))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err

def test_the_lab_refuses_torchrun_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")                                 # as torchrun sets it
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        rl.parse_args(tiny_argv(tmp_path))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not under torchrun" in err and err.count("\n") == 1, err

def test_lab_rl_resume_continues_the_run_that_was_never_interrupted(tmp_path, monkeypatch):
    """python -m lab.rl --resume from the checkpoint of step 2 ends where the run of 4 steps straight does."""
    # a tiny model's groups all tie: fixed advantages of both signs make every step update
    fixed_advantages = lambda rewards, G: torch.linspace(-1, 1, len(rewards))
    monkeypatch.setitem(objectives.ADVANTAGES, "group", fixed_advantages)
    fixed = ["--rl-lr", "1e-2", "--sft-steps", "30"]
    rl.main(tiny_argv(tmp_path, *fixed, "--rl-steps", "4", "--run-name", "straight"))
    interrupted = ["--run-name", "interrupted", "--stage", "rl"]
    rl.main(tiny_argv(tmp_path, *fixed, "--rl-steps", "2", *interrupted))
    rl.main(tiny_argv(tmp_path, *fixed, "--rl-steps", "4", *interrupted, "--resume"))
    a, b = (torch.load(tmp_path / run / "ckpt.pt", weights_only=True) for run in ("straight", "interrupted"))
    sft = torch.load(bgpo.sft_path(rl.parse_args(tiny_argv(tmp_path, *fixed))), weights_only=True)["model"]
    assert a["step"] == b["step"] == 4 and not torch.equal(a["model"]["head.weight"], sft["head.weight"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    logs = [figures.read_log(tmp_path / name / "log.jsonl") for name in ("straight", "interrupted")]
    assert [{k: v for k, v in r.items() if "seconds" not in k} for r in logs[0]] == \
           [{k: v for k, v in r.items() if "seconds" not in k} for r in logs[1]]

def test_phases_counts_each_call_of_the_run_and_its_seconds_add_up_to_the_whole(tmp_path, capsys):
    argv = tiny_argv(tmp_path, "--rl-steps", "3", "--eval-every", "2")
    rows, calls = phases.main(argv)
    log = figures.read_log(str(tmp_path / bgpo.parse_args(argv).run_name / "log.jsonl"))
    assert calls["run_rl: rollouts"] == 3 and calls["run_rl: update"] == sum(
        r.get("mixed_groups", 0) > 0 for r in log), calls   # an update where some group's rewards differ
    assert calls["run_rl: test"] == 3, "step 0, step 2 and the last step"
    assert calls["final: test"] == 2 and calls["run_sft: test"] == 0, calls
    assert calls["run_sft: validation"] == 2, "SFT steps 50 and 100"
    assert all(s >= 0 for s in rows.values()) and "where the" in capsys.readouterr().out
    assert bgpo.evaluate.__module__ == "bgpo", "the timers are taken off again"

def test_phases_without_an_sft_model_exits_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.command_line(lambda: phases.main(tiny_argv(tmp_path, "--stage", "rl")), "python -m lab.phases")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("python -m lab.phases: error: no checkpoint at"), err
    assert err.count("\n") == 1 and bgpo.run_rl.__module__ == "bgpo", "the timers are taken off again"

def test_the_readme_figure_shows_what_the_run_printed_and_logged(tmp_path, capsys):
    """python -m lab.readme_figure after a bgpo.py run: the sampler's states are those bgpo.show_unmasking
    prints for the same model and prompt, the curves are the SFT checkpoint's and the log's, and the picture
    (where matplotlib is installed) is under 200 KB; without the run, one line and exit code 2."""
    argv = tiny_argv(tmp_path, "--sft-steps", "100", "--rl-steps", "2", "--eval-every", "1")
    with pytest.raises(SystemExit) as e:
        readme_figure.main(argv)
    assert e.value.code == 2 and "run python bgpo.py with the same flags first" in capsys.readouterr().err
    bgpo.main(argv)
    args, task = bgpo.parse_args(argv), get_task("arithmetic")
    data = readme_figure.figure_data(args, task)
    capsys.readouterr()
    model = bgpo.load_model(str(tmp_path / args.run_name / "ckpt.pt"), task, args)
    answer = bgpo.show_unmasking(model, task, data["prompt"], args)
    printed = "".join(capsys.readouterr().out.split("\n")[1:]).split()
    assert printed == data["states"] and data["states"][-1].split("$")[0] == answer
    assert data["solved"] == (task.reward(data["prompt"], answer) == 1.0)
    assert sorted(data["steps"]) == list(range(task.gen_len))   # one token committed a sampler step
    curve = bgpo.load_checkpoint(bgpo.sft_path(args), task)["curve"]
    assert data["sft"] == [(c["step"], c["val_reward"]) for c in curve]
    log = figures.read_log(tmp_path / args.run_name / "log.jsonl")
    assert data["test"] == [(r["step"], r["accuracy"]) for r in log]
    assert data["rollouts_solved"] == [(r["step"], r["solved"]) for r in log[1:]]
    png = readme_figure.main([*argv, "--png", str(tmp_path / "first.png")])
    assert png is None or os.path.getsize(png) < 200 * 1024

def test_reach_reports_greedy_accuracy_entropy_and_new_solves_against_a_reference(tmp_path, capsys):
    """python -m lab.reach: pass@k per sampler, then the greedy accuracy and the policy's entropy on the same
    problems; with --reference (here the SFT model's own --json) the new solves: answered right greedily and
    never solved in the reference's samples at the rollout temperature, checked against the two JSONs and on
    made-up counts by hand. A reference of another number of problems is refused (RunError). --samplers
    low_confidence draws LLaDA's sampler's samples alone, the same ones, and counts the same new solves."""
    argv = tiny_argv(tmp_path, "--problems", "4", "--samples", "4")
    reference = str(tmp_path / "sft.json")
    reach.main([*argv, "--json", reference])
    first = json.load(open(reference))
    assert len(first["greedy"]) == 4 and first["new_solves"] is None and first["entropy"] > 0
    sft = bgpo.sft_path(bgpo.parse_args(tiny_argv(tmp_path)))
    reach.main([*argv, "--model", sft, "--reference", reference, "--json", str(tmp_path / "again.json")])
    again = json.load(open(tmp_path / "again.json"))
    counts = next(r for r in first["table"] if (r["remasking"], r["temperature"]) == ("low_confidence", 1.3))
    assert again["new_solves"] == [int(g == 1 and c == 0) for g, c in zip(again["greedy"], counts["solves"])]
    assert "new solves: " in capsys.readouterr().out
    made_up = {"table": [{"remasking": "low_confidence", "temperature": 1.3, "solves": [0, 3, 0, 2]}]}
    assert reach.new_solves([1, 1, 0, 0], made_up, 1.3) == [1, 0, 0, 0]
    with pytest.raises(bgpo.RunError, match="the reference scored 4 problems, this model 3"):
        reach.new_solves([1, 1, 0], made_up, 1.3)
    reach.main([*argv, "--model", sft, "--samplers", "low_confidence", "--reference", reference,
                "--json", str(tmp_path / "lc.json")])
    lc = json.load(open(tmp_path / "lc.json"))
    assert [(r["remasking"], r["temperature"]) for r in lc["table"]] == [("low_confidence", 1.3),
                                                                         ("low_confidence", 1.0)]
    assert [r["solves"] for r in lc["table"]] == [r["solves"] for r in again["table"][:2]]   # the same draws
    assert lc["new_solves"] == again["new_solves"]
    with pytest.raises(SystemExit):
        reach.main([*argv, "--samplers", "low-confidence"])
    assert lc["greedy"] == [int(r == 1.0) for r in lc["greedy_reward"]]
    assert set(lc["unconverted"]) == {"1.3", "1.0"}
    # the reach not turned into answers, by hand: problems 1 and 3 solved in the samples but not greedily
    # (greedy 0.1: wrong; 0: malformed); problem 0 answered greedily; the reference solved problem 3 only
    row = {"remasking": "low_confidence", "temperature": 1.0, "solves": [2, 1, 0, 5]}
    ref = {"table": [{**row, "solves": [0, 0, 4, 1]}]}
    split = reach.reach_not_answered([1.0, 0.1, 0.0, 0.0], row, ref)
    assert split == {"reached": 2, "malformed": 1, "wrong": 1, "reference_reached": 1}, split

def test_a_simulated_cuda_machine_fakes_the_card_in_every_process_of_its_command(tmp_path):
    """python -m lab.simulated_cuda runs a command whose processes see the faked card: bgpo.py, a process it
    starts, refuses a GTX 1080 (compute capability 6.1), which PyPI's CUDA 13 wheel has no kernels for, in one
    line, as it would on that card."""
    card = "NVIDIA GeForce GTX 1080"
    run = subprocess.run([sys.executable, "-m", "lab.simulated_cuda", "--card", f"{card},6.1,8", "--",
                          sys.executable, "bgpo.py", "--out-dir", str(tmp_path)],
                         cwd=gpu_report.ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr[-2000:]
    said = f"bgpo.py: error: the {card} (compute capability 6.1) has no kernels"
    assert run.stderr.startswith(said), run.stderr

@pytest.mark.parametrize("argv, message", [
    (["--card", "RTX 4090"], "--card 'RTX 4090': not NAME,MAJOR.MINOR,GIB"),
    (["--card", "A,8.x,24", "--", "true"], "not NAME,MAJOR.MINOR,GIB"), ([], "no command to run")])
def test_a_bad_simulated_cuda_flag_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        simulated_cuda.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
