"""
A machine whose PyTorch sees CUDA cards, simulated on the CPU: what bgpo.py decides from a card (the size,
--dtype, --mc-chunk, its first line, whether the build has kernels for the card) is tested where no card is.

    python -m lab.simulated_cuda -- python -m pytest -q     # the suite as an RTX 4090's owner runs it
    python -m lab.simulated_cuda --card "NVIDIA GeForce GTX 1080,6.1,8" -- python bgpo.py   # an older card

The command runs with this folder on PYTHONPATH, so Python imports its sitecustomize.py at the start of every
process: the command's and each it starts (torchrun's workers, the tests' forkserver and subprocesses). That
replaces torch.cuda's queries with the faked cards': is_available() is True; device_count(),
get_device_properties(i), get_device_name(i) and get_device_capability(i) are theirs; get_arch_list() names
the kernels of PyPI's CUDA 13 wheel. Nothing computes on a card: a tensor on "cuda" still fails, as it does on
this machine, so the tests that need a real card are skipped there (`needs_real_cuda` in lab/testing.py).
"""
import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

# the compute capabilities PyPI's CUDA 13 wheel has kernels for: torch.cuda.get_arch_list() of torch
# 2.14.1+cu130 on x86-64 (read on a machine without a card; its torch/cuda/__init__.py lists the same)
CUDA_13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
RTX_4090 = "NVIDIA GeForce RTX 4090,8.9,24"

def parse_card(text):
    """"NAME,MAJOR.MINOR,GIB" -> a card's properties as torch.cuda.get_device_properties gives them."""
    name, capability, gib = text.rsplit(",", 2)
    major, minor = map(int, capability.split("."))
    return SimpleNamespace(name=name, major=major, minor=minor, total_memory=int(float(gib) * 2**30),
                           multi_processor_count=128)

def simulate(cards, archs=CUDA_13_ARCHS):
    """Make this process's torch.cuda answer as a machine holding `cards` (their "NAME,MAJOR.MINOR,GIB")."""
    import torch
    cards = [parse_card(card) for card in cards]

    def properties(device=None):
        index = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if index.type != "cuda" or not 0 <= (index.index or 0) < len(cards):
            raise AssertionError("Invalid device id")   # what torch.cuda.get_device_properties raises
        return cards[index.index or 0]

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: len(cards)
    torch.cuda.get_device_properties = properties
    torch.cuda.get_device_name = lambda device=None: properties(device).name
    torch.cuda.get_device_capability = lambda device=None: (lambda card: (card.major, card.minor))(
        properties(device))
    torch.cuda.get_arch_list = lambda: list(archs)

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, as bgpo.py's flags
        self.exit(2, f"{self.prog}: error: {message}\n")

def main(argv=None):
    p = ArgumentParser(prog="python -m lab.simulated_cuda", description=__doc__.strip().split("\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--card", action="append",
                   help=f"a card, NAME,MAJOR.MINOR,GIB; again for more (None: one {RTX_4090})")
    p.add_argument("--archs", default=" ".join(CUDA_13_ARCHS), help="the build's kernels, get_arch_list()")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    cards = args.card or [RTX_4090]
    for card in cards:
        try:
            parse_card(card)
        except ValueError:
            p.error(f"--card {card!r}: not NAME,MAJOR.MINOR,GIB")
    if not command:
        p.error("no command to run, as in -- python -m pytest -q")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, root, os.environ.get("PYTHONPATH", "")])
    # the first sitecustomize on the path is the one Python imports: this one stands in for any other
    env = {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "SIMULATED_CUDA": json.dumps(cards),
           "SIMULATED_CUDA_ARCHS": args.archs}
    sys.exit(subprocess.run(command, env=env).returncode)
