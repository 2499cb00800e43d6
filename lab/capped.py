"""
A CUDA memory cap, to stand in for a smaller GPU on a bigger one (a 24 GB consumer card on an 80 GB H100),
and a script run under it:

    python -m lab.capped 24 bgpo.py --size gpu        # bgpo.py with at most 24 GiB of the GPU's memory

The cap is PyTorch's per-process fraction of the card's memory: past it an allocation raises
torch.OutOfMemoryError, as on the smaller card. Off CUDA there is nothing to cap and the script runs as is.
"""
import os
import runpy
import sys

import torch

def cap_memory(device, gib):
    """Cap this process's allocations on a CUDA device ("cuda" or "cuda:N") at gib GiB. PyTorch wants the
    device's index: the bare "cuda" is refused (ValueError), so it is the current device's."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        sys.exit(0)
    try:
        gib, script, *rest = float(argv[0]), argv[1], *argv[2:]
    except (IndexError, ValueError):
        gib = None
    if gib is None or not gib > 0 or not os.path.isfile(script):   # one line and exit 2, as bgpo.py's flags
        print("python -m lab.capped: error: " + (f"no script {script!r}" if gib and gib > 0 else
              "usage: python -m lab.capped GIB SCRIPT [ARGS ...], GIB > 0 (24)"), file=sys.stderr)
        sys.exit(2)
    if torch.cuda.is_available():
        cap_memory("cuda", gib)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")

if __name__ == "__main__":
    main()
