"""
Where the seconds of one `python bgpo.py` go: bgpo.main run as it is, the functions it calls wrapped by a
timer (nothing else changes: the run prints and writes what it always does), then a table by phase.

    python -m lab.phases [bgpo.py flags]          # e.g. --seed 10 --out-dir /tmp/phases

The phases: SFT's training steps (run_sft less its evaluations); SFT's greedy evaluations, on the validation
problems (they choose the model kept) and on test ones (bgpo.py scored them before commit 143bc9f);
RL's rollouts (sample_rollouts: the sampler and the verifier), its update (bgpo_backward; with --objective
naive, naive_loss's forward only, its backward falls in the rest), its test evaluations and the rest of
its steps (advantages, masked copies, the gradient clip, AdamW, the log); the final paired comparison (both
models on the test problems); the rest (setup, the unmasking shown, checkpoints). The timers read the
host's clock without waiting for a GPU: on CUDA a phase's kernels may be counted in a later one.
"""
import collections
import sys
import time

import bgpo
from lab import cli

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    seconds, calls, stage = collections.Counter(), collections.Counter(), ["setup"]
    inner = {name: getattr(bgpo, name) for name in
             ("evaluate", "sample_rollouts", "bgpo_backward", "naive_loss", "run_sft", "run_rl",
              "test_problems")}

    def timed(name, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            if name in ("run_sft", "run_rl"):
                stage[0] = name
            try:
                return inner[name](*args, **kwargs)
            finally:
                label = key(*args) if callable(key) else key
                seconds[label] += time.perf_counter() - t0
                calls[label] += 1
                if name in ("run_sft", "run_rl"):
                    stage[0] = "final"
        return wrapper

    tests = {}   # the same list object for each call, so that an evaluation of it can be told apart
    patches = {"test_problems": lambda task, args: tests.setdefault(task.name,
                                                                     inner["test_problems"](task, args)),
               "evaluate": timed("evaluate", lambda model, task, prompts, args: f"{stage[0]}: " + (
                   "test" if prompts is tests.get(task.name) else "validation")),
               "sample_rollouts": timed("sample_rollouts", "run_rl: rollouts"),
               "bgpo_backward": timed("bgpo_backward", "run_rl: update"),
               "naive_loss": timed("naive_loss", "run_rl: update"),
               "run_sft": timed("run_sft", "run_sft"), "run_rl": timed("run_rl", "run_rl")}
    t0 = time.perf_counter()
    try:
        for name, wrapper in patches.items():
            setattr(bgpo, name, wrapper)
        bgpo.main(argv)
    finally:
        for name, function in inner.items():
            setattr(bgpo, name, function)
    total = time.perf_counter() - t0
    rows = [("SFT: training steps", seconds["run_sft"] - seconds["run_sft: validation"]
             - seconds["run_sft: test"]),
            ("SFT: validation evaluations", seconds["run_sft: validation"]),
            ("SFT: test evaluations", seconds["run_sft: test"]),
            ("RL: rollouts (sampler + verifier)", seconds["run_rl: rollouts"]),
            ("RL: update (forward + backward)", seconds["run_rl: update"]),
            ("RL: test evaluations", seconds["run_rl: test"]),
            ("RL: the rest of its steps", seconds["run_rl"] - seconds["run_rl: rollouts"]
             - seconds["run_rl: update"] - seconds["run_rl: test"]),
            ("final paired comparison", seconds["final: test"])]
    rows.append(("the rest (setup, unmasking shown, checkpoints)", total - sum(s for _, s in rows)))
    print(f"\nwhere the {total:.1f} s went ({bgpo.torch.get_num_threads()} threads):")
    for name, s in rows:
        print(f"  {name:<48} {s:7.1f} s {s / total:6.1%}")
    print("  calls: " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items()) if ":" in k))
    return dict(rows), calls

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.phases")
