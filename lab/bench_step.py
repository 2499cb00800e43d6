"""
Seconds per RL step, and the model FLOP utilisation (MFU) beside them: bgpo.py's step on this device against
the same step by the float32 path it had before its GPU lines (every forward in float32 without TF32, the
sampler's and the MC draws' random numbers drawn on the CPU and copied over, the activation meter's hooks on
every step), side by side in one process, on one model, with the same batches.

    python -m lab.bench_step [--steps 20] [--warmup 3] [--compile] [--cap-gib 24] [any bgpo.py flag]
    python -m lab.bench_step --size gpu --device cuda --cap-gib 24     # the GPU size on a 24 GB budget

The step is bgpo.run_rl's loop body for one on-policy BGPO update (a copy): fresh prompts, G rollouts each
at the rollout temperature with the verifier's rewards, n_t MC draws, bgpo_backward, gradient clipping, AdamW.
The advantages come from random rewards, which never tie, so every row is in the update (the model is fresh:
its own rewards would all tie and leave nothing to update). Time: the median over --steps steps after
--warmup (torch.compile compiles in those), with the device synchronised around each step.

MFU as nanoGPT's estimate_mfu counts it: a token's forward pass costs 2N + 4 n_layer T C FLOPs (N parameters
without the position table, T tokens, C the width) and forward plus backward three times that. A step runs
the sampler's gen_len forward passes over B = G x prompts rows, then n_t forward and backward passes over
them. The peak is the card's dense bf16 peak (--peak-tflops, or the table below by the device's name), for
both paths, as nanoGPT quotes it; on the CPU MFU is left out unless --peak-tflops is given.
"""
import argparse
import contextlib
import statistics
import time

import torch

import bgpo
from lab import cli
from tasks import get_task
from tiny_dllm import ActivationMemory

PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "4090": 165.2, "L4": 121.0}  # dense bf16, by name

def step_flops(model, task, args):
    """The model FLOPs of one step by nanoGPT's count: the sampler's gen_len forward passes over the B rows
    (one token committed a pass), then n_t forward and backward passes over them (every row in the update)."""
    N = model.num_params() - model.pos_emb.weight.numel()
    T, C, B = task.prompt_len + task.gen_len, args.n_embd, args.group_size * args.prompts_per_step
    forward = 2 * N + 4 * args.n_layer * T * C          # a token's forward pass
    return B * T * (task.gen_len + 3 * args.mc_samples) * forward

def rl_step(model, optimizer, task, args, generator, noise, meter):
    """One on-policy BGPO step, as bgpo.run_rl's loop body makes it (a copy; advantages of random rewards).
    Returns the activation meter's peak bytes in the update (one MC copy's, or one --mc-chunk's), or None."""
    G, B, L = args.group_size, args.group_size * args.prompts_per_step, task.gen_len
    prompts = task.sample(B // G, "train", generator)[0]
    x, y, rewards = bgpo.sample_rollouts(model, task, prompts, args, noise)
    A = bgpo.group_advantages(torch.rand(B, generator=generator), G).to(args.device)   # every row updated
    mc = bgpo.draw_mc_samples(B, L, args.mc_samples, noise).to(args.device)
    optimizer.zero_grad(set_to_none=True)
    with ActivationMemory(model) if meter else contextlib.nullcontext() as memory, bgpo.autocast(args):
        bgpo.bgpo_backward(model, x, y, mc, None, A, None, args.mc_chunk)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return memory.peak if meter else None

def time_path(task, args, path, bench):
    """One path ("float32" or "bgpo.py"): median seconds per step, CUDA peak MiB (or None), the update's
    activation MiB by the meter (or None where it is off), and the model."""
    cuda = args.device.startswith("cuda")
    args = argparse.Namespace(**{**vars(args), "dtype": "float32" if path == "float32" else args.dtype})
    torch.set_float32_matmul_precision("high" if cuda and path == "bgpo.py" else "highest")
    torch.manual_seed(args.seed)
    model = bgpo.make_model(task, args)
    if bench.compile and path == "bgpo.py":
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=bgpo.RL_LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    new_gpu_path = cuda and path == "bgpo.py"
    noise = torch.Generator(args.device).manual_seed(args.seed + 2) if new_gpu_path else generator
    if cuda:
        torch.cuda.reset_peak_memory_stats(args.device)
    seconds = []
    for step in range(bench.warmup + bench.steps):
        if cuda:
            torch.cuda.synchronize(args.device)
        t0 = time.perf_counter()
        activations = rl_step(model, optimizer, task, args, generator, noise, meter=not new_gpu_path)
        if cuda:
            torch.cuda.synchronize(args.device)
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(args.device) / 2**20 if cuda else None
    return statistics.median(seconds[bench.warmup:]), peak, activations and activations / 2**20, model

def peak_flops(args, bench):
    if bench.peak_tflops:
        return bench.peak_tflops * 1e12
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name(args.device)
        return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)
    return None

def main(argv=None):
    p = cli.ArgumentParser(prog="python -m lab.bench_step", description=__doc__.strip().split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps timed per path (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="steps run first, not timed")
    p.add_argument("--compile", action="store_true", help="torch.compile the model of bgpo.py's path")
    p.add_argument("--cap-gib", type=float, default=None,
                   help="CUDA: cap this process's GPU memory (24: a consumer GPU's budget on a bigger card)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"the device's dense bf16 peak for MFU (None: by its name, {PEAK_TFLOPS})")
    bench, rest = p.parse_known_args(argv)   # the rest are bgpo.py's flags, checked by bgpo.parse_args
    if bench.steps < 1 or bench.warmup < 0:
        p.error(f"--steps must be at least 1 and --warmup at least 0, got {bench.steps} and {bench.warmup}")
    args = bgpo.parse_args(rest)
    cuda, task = args.device.startswith("cuda"), get_task(args.task)
    if bench.cap_gib and cuda:
        total = torch.cuda.get_device_properties(args.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, bench.cap_gib * 2**30 / total), args.device)
    device = torch.cuda.get_device_name(args.device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    peak = peak_flops(args, bench)
    rows = {}
    for path in ("float32", "bgpo.py"):
        rows[path] = time_path(task, args, path, bench)
    model = rows["bgpo.py"][-1]
    flops, B = step_flops(model, task, args), args.group_size * args.prompts_per_step
    print(f"model {model.num_params() / 1e6:.2f}M parameters | {task.name}, {B} rollouts, "
          f"L = {task.gen_len}, n_t {args.mc_samples} | {flops / 1e12:.3f} TFLOP a step | {device}, "
          f"PyTorch {torch.__version__} | median of {bench.steps} steps after {bench.warmup}"
          + (f" | memory capped at {bench.cap_gib:g} GiB" if bench.cap_gib and cuda else ""))
    print("  s/step speed-up     MFU act MiB" + (" CUDA peak MiB" if cuda else "") + " | path")
    labels = {"float32": "float32, random numbers drawn on the CPU, activation meter (before the GPU lines)",
              "bgpo.py": f"bgpo.py: {args.dtype}" + (", TF32, random numbers on the GPU, no meter" if cuda
                                                     else "") + (", torch.compile" if bench.compile else "")}
    for path, (seconds, cuda_mb, act_mb, _) in rows.items():
        mfu = f"{flops / seconds / peak:7.1%}" if peak else f"{'-':>7}"
        print(f"{seconds:8.4f} {rows['float32'][0] / seconds:7.2f}x {mfu} "
              + (f"{act_mb:7.1f}" if act_mb else f"{'-':>7}") + (f" {cuda_mb:13.0f}" if cuda else "")
              + f" | {labels[path]}")
    return {path: {"s": seconds, "cuda_mb": cuda_mb, "act_mb": act_mb,
                   "mfu": flops / seconds / peak if peak else None}
            for path, (seconds, cuda_mb, act_mb, _) in rows.items()}

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.bench_step")
