"""
One run's two stages in one figure: the SFT curve (greedy validation accuracy against training
seconds), then, from the SFT model it kept, the RL run's progress accuracy and, if it was
run (python -m lab.control), the control's: SFT continued for the same time.

    python -m lab.stages [the run's flags] [--png stages.png]
"""
import os

import bgpo
from lab import cli
from lab.figures import draw, read_log, stages_figure
from tasks import get_task

def main(argv=None):
    p = cli.make_parser("python -m lab.stages", __doc__.strip().split("\n\n")[0])
    p.add_argument("--png", default="stages.png", help="the figure's file name in the run's folder")
    args = cli.check_args(p, p.parse_args(argv))
    run_dir = os.path.join(args.out_dir, args.run_name)
    if not os.path.isfile(os.path.join(run_dir, "log.jsonl")):
        p.error(f"no RL log at {os.path.join(run_dir, 'log.jsonl')}")
    sft = bgpo.load_checkpoint(bgpo.sft_path(args), get_task(args.task))
    control = os.path.join(run_dir + "_sft-continued", "log.jsonl")
    figure = stages_figure(sft["curve"], read_log(os.path.join(run_dir, "log.jsonl")),
                           read_log(control) if os.path.isfile(control) else None)
    return draw({**figure, "width": 6.4}, os.path.join(run_dir, args.png))

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.stages")
