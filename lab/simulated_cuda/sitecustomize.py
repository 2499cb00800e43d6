"""Imported by Python at the start of every process that `python -m lab.simulated_cuda` runs (PYTHONPATH)."""
import json
import os

if "SIMULATED_CUDA" in os.environ:
    from lab.simulated_cuda import simulate
    simulate(json.loads(os.environ["SIMULATED_CUDA"]), os.environ["SIMULATED_CUDA_ARCHS"].split())
