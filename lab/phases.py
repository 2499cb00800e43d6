"""
Where the seconds of one `python bgpo.py` go: bgpo.main run as it is, with the functions it calls wrapped by a
timer (nothing else changes; the run's console and files are its own), then a table by phase.

    python -m lab.phases [bgpo.py flags]          # e.g. --seed 10 --out-dir /tmp/phases

The phases: SFT's training steps (run_sft less its evaluations); SFT's greedy evaluations, on the validation
problems (which choose the model kept) and on the held-out ones (shown beside them); RL's rollouts
(sample_rollouts: the sampler and the verifier), its update (bgpo_backward, or the naive objective's forward and
backward), its held-out evaluations and the rest of its steps (advantages, MC draws, the gradient clip, AdamW,
the log); the final paired comparison (both models on the held-out problems); and what is left (imports,
the unmasking shown, checkpoints).
"""
import collections
import sys
import time

import bgpo

seconds, calls, stage = collections.Counter(), collections.Counter(), ["start"]

def timed(module, name, label):
    """Replace module.name by a wrapper that adds its seconds to seconds[label(...)]."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            key = label(*args, **kwargs) if callable(label) else label
            seconds[key] += time.perf_counter() - t0
            calls[key] += 1
    setattr(module, name, wrapper)

def staged(name):   # run_sft and run_rl: set the stage their evaluations are counted under
    inner = getattr(bgpo, name)

    def wrapper(*args, **kwargs):
        stage[0] = name
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - t0
            stage[0] = "final"
    setattr(bgpo, name, wrapper)

def evaluation(model, task, prompts, args, n_show=3):
    return f"{stage[0]}: " + ("held-out" if prompts is bgpo.held_out(task, args) else "validation")

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    held_out = bgpo.held_out
    cache = {}
    bgpo.held_out = lambda task, args: cache.setdefault((task.name, args.eval_size), held_out(task, args))
    timed(bgpo, "evaluate", evaluation)
    timed(bgpo, "sample_rollouts", "run_rl: rollouts")
    timed(bgpo, "bgpo_backward", "run_rl: update")
    timed(bgpo, "naive_loss", "run_rl: update")
    staged("run_sft")
    staged("run_rl")
    t0 = time.perf_counter()
    bgpo.main(argv)
    total = time.perf_counter() - t0
    rows = [("SFT: training steps", seconds["run_sft"] - seconds["run_sft: validation"]
             - seconds["run_sft: held-out"]),
            ("SFT: validation evaluations", seconds["run_sft: validation"]),
            ("SFT: held-out evaluations (shown only)", seconds["run_sft: held-out"]),
            ("RL: rollouts (sampler + verifier)", seconds["run_rl: rollouts"]),
            ("RL: update (forward + backward)", seconds["run_rl: update"]),
            ("RL: held-out evaluations", seconds["run_rl: held-out"]),
            ("RL: the rest of its steps", seconds["run_rl"] - seconds["run_rl: rollouts"]
             - seconds["run_rl: update"] - seconds["run_rl: held-out"]),
            ("final paired comparison", seconds["final: held-out"])]
    rows.append(("the rest (setup, unmasking shown, checkpoints)", total - sum(s for _, s in rows)))
    print(f"\nwhere the {total:.1f} s went ({bgpo.torch.get_num_threads()} threads):")
    for name, s in rows:
        print(f"  {name:<48} {s:7.1f} s {s / total:6.1%}")
    print("  calls: " + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())))
    return rows

if __name__ == "__main__":
    main()
