"""
Figures: each is first plain data, the lines it plots (which the tests check), then drawn by draw(),
the one function that needs matplotlib; without it every command still runs and says what it skipped.
"""
import json
import os

def read_log(path):
    return [json.loads(line) for line in open(path)]

def curves_figure(runs):
    """The paper's Fig. 2 in small: {label: a run's log.jsonl records} -> the rollout reward (mean of the
    last 10 steps; a single run also shows each step's) and the progress accuracy against the RL step."""
    reward, accuracy = [], []
    for label, records in runs.items():
        steps, evals = [r for r in records if "reward" in r], [r for r in records if "accuracy" in r]
        ys = [r["reward"] for r in steps]
        if len(runs) == 1:
            reward.append({"label": "each step", "x": [r["step"] for r in steps], "y": ys, "alpha": 0.3})
        reward.append({"label": label, "x": [r["step"] for r in steps],
                       "y": [sum(ys[max(0, i - 9):i + 1]) / min(i + 1, 10) for i in range(len(ys))]})
        accuracy.append({"label": label, "x": [r["step"] for r in evals], "y": [r["accuracy"] for r in evals],
                         "style": "o-"})
    return {"panels": [{"title": "rollout reward (mean of the last 10 steps)", "xlabel": "RL step",
                        "lines": reward},
                       {"title": "progress accuracy (greedy)", "xlabel": "RL step", "lines": accuracy}]}

def stages_figure(sft_curve, rl_records, control=None):
    """SFT, then RL, against training seconds: the SFT checkpoint's curve (greedy validation accuracy: SFT
    scores no test problem), and from the selected SFT model on, the RL run's progress accuracy beside
    the control's (SFT continued for the same time). sft_curve: the SFT checkpoint's "curve"; rl_records:
    log.jsonl; control: control.jsonl, if the control was run."""
    best = max(sft_curve, key=lambda c: c["val_reward"])      # the first best, the one SFT keeps
    t0, rl, seconds = best["seconds"], [], 0.0
    for r in rl_records:
        seconds += r.get("seconds", 0.0)
        if "accuracy" in r:
            rl.append((t0 + seconds, r["accuracy"]))
    lines = [{"label": "SFT: validation accuracy", "x": [c["seconds"] for c in sft_curve],
              "y": [c["val_accuracy"] for c in sft_curve], "style": "--", "alpha": 0.6},
             {"label": f"SFT + RL (from SFT step {best['step']})", "x": [x for x, _ in rl],
              "y": [y for _, y in rl], "style": "o-"}]
    if control:
        lines.append({"label": "SFT continued (control)", "x": [t0 + c["seconds"] for c in control],
                      "y": [c["accuracy"] for c in control], "style": "s-"})
    return {"panels": [{"title": "greedy accuracy: SFT on the demonstrations, then RL",
                        "xlabel": "training seconds", "lines": lines}]}

def draw(figure, png_path):
    """One PNG, a panel per figure["panels"] entry (in figure.get("rows", 1) rows), a line per panel["lines"]
    entry."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print(f"matplotlib is not installed; skipped {png_path}")
    rows = figure.get("rows", 1)   # the panels fill rows of ceil(panels / rows), left to right
    columns = -(-len(figure["panels"]) // rows)
    width = figure.get("width", 4.2 * columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width, 3.3 * rows), squeeze=False)
    for ax in axes.flat[len(figure["panels"]):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, figure["panels"]):
        for line in panel["lines"]:
            drawn, = ax.plot(line["x"], line["y"], line.get("style", "-"), label=line["label"],
                             alpha=line.get("alpha", 1.0), markersize=3, color=line.get("color"))
            if "band" in line:   # (low, high): an interval around the line, in its colour
                ax.fill_between(line["x"], *line["band"], color=drawn.get_color(), alpha=0.15, linewidth=0)
        ax.set(xlabel=panel["xlabel"], xscale=panel.get("xscale", "linear"),
               yscale=panel.get("yscale", "linear"))
        if "xticks" in panel:   # these ticks only, labelled as plain numbers (a log axis would say 2 x 10^0)
            ax.set_xticks(panel["xticks"], [str(x) for x in panel["xticks"]], minor=False)
            ax.set_xticks([], minor=True)
        ax.set_title(panel["title"], fontsize=9)
        if panel["lines"]:
            ax.legend(fontsize=7)
    return save(fig, png_path)

def save(fig, png_path):
    """Lay out a drawn matplotlib figure, write it to png_path (its folder made if need be), close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(os.path.dirname(png_path) or ".", exist_ok=True)
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    print(f"wrote {png_path}")
    return png_path
