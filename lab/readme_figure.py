"""
The README's first picture, drawn from a run of bgpo.py: how the run's final model writes its answer to the
first test problem it solves, one token committed a sampler step, beside the run's two curves (SFT's
validation reward, by which it keeps a model, then RL's test accuracy and the share of rollouts that solve).

    python bgpo.py [flags]; python -m lab.readme_figure [the same flags] [--png figures/first_run.png]
"""
import os
import sys

import bgpo
from lab import cli
from lab.figures import read_log, save
from tasks import encode, get_task
from tiny_dllm import generate

def unmasking(model, task, prompt, args):
    """The greedy sampler's states as bgpo.show_unmasking prints them: after sampler step s (s = 1..L) the
    tokens committed so far, '_' for MASK and '$' for EOS. Returns (states, the step each position was
    committed at)."""
    x = encode(task, [prompt], device=args.device)
    with bgpo.autocast(args):
        y, steps = generate(model, x, task.gen_len, return_steps=True)
    states = [task.decode(y[0].masked_fill(steps[0] > s, model.config.mask_id).cpu(), False)
              for s in range(len(y[0]))]
    return states, steps[0].tolist()

def figure_data(args, task):
    """The picture's data: the first test problem the run's last checkpoint solves (greedy), the sampler's
    states and commit steps on it, the SFT curve (step, validation reward) with the step kept, and RL's
    (step, test accuracy) and (step, share of rollouts solved)."""
    run_dir = os.path.join(args.out_dir, args.run_name)
    sft = bgpo.load_checkpoint(bgpo.sft_path(args), task)
    records = read_log(os.path.join(run_dir, "log.jsonl"))
    model = bgpo.load_model(os.path.join(run_dir, "ckpt.pt"), task, args)
    for prompt in bgpo.test_problems(task, args):   # the first it solves, or else the last
        states, steps = unmasking(model, task, prompt, args)
        solved = task.reward(prompt, states[-1].split("$")[0]) == 1.0
        if solved:
            break
    return {"prompt": prompt, "solved": solved, "states": states, "steps": steps, "kept": sft["step"],
            "sft": [(c["step"], c["val_reward"]) for c in sft["curve"]],
            "test": [(r["step"], r["accuracy"]) for r in records if "accuracy" in r],
            "rollouts_solved": [(r["step"], r["solved"]) for r in records if "solved" in r]}

def draw(data, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print(f"matplotlib is not installed; skipped {png_path}")
    fig, (text, sft, rl) = plt.subplots(1, 3, figsize=(11, 3.2), gridspec_kw={"width_ratios": [1.1, 1, 1]})
    L = len(data["states"])
    for s, state in enumerate(data["states"]):   # row s: the state after sampler step s + 1
        for i, char in enumerate(state):
            new = data["steps"][i] == s
            text.text(i, -s, char, ha="center", va="center", family="monospace", fontsize=9,
                      color="crimson" if new else "gray" if char == "_" else "black",
                      fontweight="bold" if new else "normal")
    text.set(xlim=(-1, L), ylim=(-L, 1), xticks=[], yticks=[-s for s in range(L)],
             yticklabels=[str(s + 1) for s in range(L)], ylabel="sampler step")
    verb = "solves" if data["solved"] else "writes"
    text.set_title(f"the RL model {verb} {data['prompt']} (red: just committed)", fontsize=9)
    sft.plot(*zip(*data["sft"]), "o-", markersize=3, label="validation reward")
    sft.axvline(data["kept"], color="gray", linestyle="--", label=f"model kept (step {data['kept']})")
    sft.set(xlabel="SFT step")
    sft.set_title("SFT on demonstrations", fontsize=9)
    rl.plot(*zip(*data["rollouts_solved"]), "-", alpha=0.3, label="rollouts solved (each step)")
    rl.plot(*zip(*data["test"]), "o-", markersize=4, label="test accuracy (greedy)")
    rl.set(xlabel="RL step")
    rl.set_title("RL with the verifier", fontsize=9)
    for ax in (sft, rl):
        ax.legend(fontsize=7)
    return save(fig, png_path)

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = bgpo.make_parser()   # bgpo.py's flags, which name the run's files, and --png
    p.prog, p.description = "python -m lab.readme_figure", __doc__.strip().split("\n\n")[0]
    p.add_argument("--png", default="figures/first_run.png", help="where the picture goes")
    png = p.parse_args(argv).png   # --help lists every flag; a bad one is one line and exit code 2
    args = bgpo.parse_args([a for i, a in enumerate(argv) if "--png" not in argv[max(i - 1, 0):i + 1]])
    task = get_task(args.task)
    for path in (bgpo.sft_path(args), os.path.join(args.out_dir, args.run_name, "ckpt.pt")):
        if not os.path.isfile(path):
            p.error(f"no {path}: run python bgpo.py with the same flags first")
    return draw(figure_data(args, task), png)

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.readme_figure")
