"""
Seconds per RL step, the model FLOP utilisation (MFU) and the ops dispatched beside them: bgpo.py's step on
this device against the same step by the float32 path it had before its GPU lines (every forward in float32
without TF32, the sampler's and the MC draws' random numbers drawn on the CPU and copied over, the activation
meter's hooks on every step, one MC copy per backward, AdamW and the gradient clip one parameter at a time),
side by side in one process, on one model, with the same batches.

    python -m lab.bench_step [--steps 20] [--warmup 3] [--compile | --graphs] [--cap-gib 24] [bgpo.py flags]
    python -m lab.bench_step --size gpu --device cuda --cap-gib 24     # the GPU size on a 24 GB budget

The step is bgpo.run_rl's loop body for one on-policy BGPO update (a copy): fresh prompts, G rollouts each
at the rollout temperature with the verifier's rewards, n_t MC draws, bgpo_backward, gradient clipping, AdamW.
The advantages come from random rewards, which never tie, so every row is in the update (the model is fresh:
its own rewards would all tie and leave nothing to update). Time: the median over --steps steps after
--warmup (torch.compile compiles in those), with the device synchronised around each step.

Ops: in one more step per path, the ATen ops dispatched (views, which launch no kernel, left out), by phase:
the sampler, the update (bgpo_backward), the optimizer (clip and AdamW) and the rest. On a GPU each is at
least one kernel launch, a few microseconds of the host's time: a small model's step is launch-bound long
before it is FLOP-bound. The count does not depend on the device's speed, so the CPU can count the GPU's
path (but for what dispatches differently there: on CUDA, flash attention). Syncs, beside them on a GPU:
the ops after which the host waits for the device (`waits`): a value read on the host (`.item()`, `float`,
an `if` on a tensor), a shape that depends on values (`nonzero`, a boolean index), a copy between the host's
memory and the device's (but a non-blocking one). The host then stops queuing kernels until the GPU catches
up. On the CPU every tensor is the host's: nothing to wait for, and the columns show "-".

MFU as nanoGPT's estimate_mfu counts it: a token's forward pass costs 2N + 4 n_layer T C FLOPs (N parameters
without the position table, T tokens, C the width) and forward plus backward three times that. A step runs
the sampler's gen_len forward passes over B = G x prompts rows, then n_t forward and backward passes over
them. The peak is the card's dense bf16 peak (--peak-tflops, or the table below by the device's name), for
both paths, as nanoGPT quotes it; on the CPU MFU is left out unless --peak-tflops is given.
"""
import argparse
import collections
import contextlib
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bgpo
from lab import cli
from lab.capped import cap_memory
from lab.graphs import GraphedSampler
from tasks import get_task
from tiny_dllm import ActivationMemory

# dense bf16 TFLOP/s (float32 accumulation), NVIDIA's data sheets: the first key the device's name contains
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1, "L40": 181.0,
               "L4": 121.0, "RTX 4090": 165.2, "RTX 3090": 71.0}

def step_flops(model, task, args, updated=None):
    """The model FLOPs of one step by nanoGPT's count: the sampler's gen_len forward passes over the B rows
    (one token committed a pass), then n_t forward and backward passes over the rows updated (None: all B)."""
    N = model.num_params() - model.pos_emb.weight.numel()
    T, C, B = task.prompt_len + task.gen_len, args.n_embd, args.group_size * args.prompts_per_step
    forward = 2 * N + 4 * args.n_layer * T * C          # a token's forward pass
    return T * (B * task.gen_len + (B if updated is None else updated) * 3 * args.mc_samples) * forward

def mixed_groups(args, mixed):
    """How many of a step's groups have rewards that differ when a share `mixed` of them do."""
    return round(mixed * args.prompts_per_step)

def updated_rows(args, mixed):
    """The rows an update takes when a share `mixed` of the groups have rewards that differ: all of them
    without --skip-tied (a fixed shape), else the mixed groups' rows alone."""
    return args.group_size * (mixed_groups(args, mixed) if args.skip_tied else args.prompts_per_step)

# no kernel: allocation and bookkeeping; .item() counts only on a device's tensor (AdamW reads its CPU steps)
NO_KERNEL = {"detach", "lift_fresh", "empty", "empty_strided", "empty_like", "_record_function_enter_new",
             "_record_function_exit"}

# ops whose output's shape depends on the input's values, or that read a value inside (equal, allclose): the
# host reads it before it can go on
VALUE_READ = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
              "repeat_interleave", "bincount", "equal", "allclose"}

def waits(func, args, kwargs):
    """Whether the ATen op func(*args, **kwargs) makes the host wait for a device: a device tensor's value
    read on the host, a value-dependent shape on a device, or a blocking copy between host and device."""
    name, tensors = func.overloadpacket.__name__, [a for a in args if isinstance(a, torch.Tensor)]
    on_device = any(t.device.type != "cpu" for t in tensors)
    if name == "_local_scalar_dense" or name in VALUE_READ:
        return on_device
    if name in ("index", "index_put", "index_put_"):   # a mask's count is a value; a host index is copied
        masks_or_host = [i.dtype in (torch.bool, torch.uint8) or i.device.type == "cpu" for i in args[1] if
                         i is not None]
        return args[0].device.type != "cpu" and any(masks_or_host)
    if name == "copy_":   # copy_(dst, src, non_blocking=False)
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and (args[0].device.type == "cpu") != (args[1].device.type == "cpu")
    if name == "_to_copy":   # x.to(device): the device is a keyword
        dst = torch.device(kwargs.get("device") or args[0].device)
        return not kwargs.get("non_blocking", False) and (dst.type == "cpu") != (args[0].device.type == "cpu")
    return False

class OpCounter(TorchDispatchMode):
    """While active (a with block): the ATen ops dispatched, views and NO_KERNEL left out, counted in
    self.counts by self.phase (set it with `with counter.at("update"):`), and those that make the host
    wait for the device (`waits`) in self.syncs."""

    def __init__(self):
        super().__init__()
        self.counts, self.syncs, self.phase = collections.Counter(), collections.Counter(), "other"

    @contextlib.contextmanager
    def at(self, phase):
        self.phase = phase
        yield
        self.phase = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        on_cpu = name == "_local_scalar_dense" and args[0].device.type == "cpu"
        if not func.is_view and name not in NO_KERNEL and not on_cpu:
            self.counts[self.phase] += 1
        self.syncs[self.phase] += waits(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))

def rl_step(model, optimizer, task, args, generator, noise, meter, ops=None, sampler=None, mixed=1.0):
    """One on-policy BGPO step, as bgpo.run_rl's loop body makes it (a copy; advantages of random rewards,
    which tie in all groups but a share `mixed`), with bgpo.autocast where run_rl has it. Counts its ops by
    phase into ops (an active OpCounter) if given. sampler: a GraphedSampler in the place of the eager one.
    Returns the activation meter's peak bytes in the update (one --mc-chunk's), or None."""
    G, B, L = args.group_size, args.group_size * args.prompts_per_step, task.gen_len
    at = ops.at if ops else lambda phase: contextlib.nullcontext()
    prompts = task.sample(B // G, "train", generator)[0]
    with at("sampler"):
        if sampler is None:
            x, y, rewards = bgpo.sample_rollouts(model, task, prompts, args, noise)
        else:   # bgpo.sample_rollouts with the graph's replay for generate
            prompts = [p for p in prompts for _ in range(G)]
            x = bgpo.encode(task, prompts, device=args.device)
            y = sampler(x)
            rewards = torch.tensor([task.reward(p, task.decode(ids)) for p, ids in zip(prompts, y.cpu())])
    r = torch.rand(B // G, G, generator=generator)     # random rewards never tie: a mixed group each
    r[mixed_groups(args, mixed):] = 0.0                 # but the last groups' rewards tie: A = 0
    A = bgpo.group_advantages(r.flatten(), G)
    mc = bgpo.draw_mc_samples(B, L, args.mc_samples, noise).to(args.device)
    rollouts = bgpo.rows_to_update(torch.arange(B), A, x, y, mc, None, args)[1]   # as run_rl takes them
    optimizer.zero_grad(set_to_none=True)
    with ActivationMemory(model) if meter else contextlib.nullcontext() as memory, at("update"), \
            bgpo.autocast(args):
        bgpo.bgpo_backward(model, *rollouts, None, args.mc_chunk)
    with at("optimizer"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=optimizer.defaults["foreach"])
        optimizer.step()
    return memory.peak if meter else None

def time_path(task, args, path, bench):
    """One path ("float32" or "bgpo.py"), timed: {"s": median seconds per step, "cuda_mb": CUDA peak MiB
    or None, "act_mb": the update's activation MiB by the meter or None, "flops": a step's, "params", "ops"
    and "syncs": a step's by phase}. The model goes when it returns: the next path does not share the memory
    (or the cap) with it."""
    cuda, old = args.device.startswith("cuda"), path == "float32"
    args = argparse.Namespace(**{**vars(args), **({"dtype": "float32", "mc_chunk": 1} if old else {})})
    torch.set_float32_matmul_precision("high" if cuda and path == "bgpo.py" else "highest")
    torch.manual_seed(args.seed)
    model = bgpo.make_model(task, args)
    step_model = torch.compile(model) if bench.compile and path == "bgpo.py" else model
    # foreach=True: what PyTorch's default (bgpo.py's) picks on CUDA, so that the CPU counts the GPU's ops
    optimizer = torch.optim.AdamW(model.parameters(), lr=bgpo.RL_LR, weight_decay=0.0, foreach=not old)
    generator = torch.Generator().manual_seed(args.seed + 1)
    new_gpu_path = cuda and path == "bgpo.py"
    noise = torch.Generator(args.device).manual_seed(args.seed + 2) if new_gpu_path else generator
    graphed = bench.graphs and new_gpu_path   # the sampler replayed from a CUDA graph, captured at step 1
    sampler = GraphedSampler(model, task.gen_len, bgpo.TEMPERATURE, noise, args.dtype) if graphed else None
    one_step = lambda ops=None: rl_step(step_model, optimizer, task, args, generator, noise,
                                        meter=not new_gpu_path, ops=ops, sampler=sampler, mixed=bench.mixed)
    if cuda:
        torch.cuda.reset_peak_memory_stats(args.device)
    seconds = []
    for step in range(bench.warmup + bench.steps):
        if cuda:
            torch.cuda.synchronize(args.device)
        t0 = time.perf_counter()
        activations = one_step()
        if cuda:
            torch.cuda.synchronize(args.device)
        seconds.append(time.perf_counter() - t0)
    cuda_mb = torch.cuda.max_memory_allocated(args.device) / 2**20 if cuda else None
    with OpCounter() as ops:   # one more step, counted (the counter's Python costs time: not timed)
        one_step(ops)
    profile = bench.profile and path == "bgpo.py" and profile_step(one_step, args.device)
    return {"s": statistics.median(seconds[bench.warmup:]), "act_mb": activations and activations / 2**20,
            "cuda_mb": cuda_mb, "flops": step_flops(model, task, args, updated_rows(args, bench.mixed)),
            "params": model.num_params(), "ops": dict(ops.counts), "syncs": dict(ops.syncs),
            "profile": profile}

def profile_step(step, device):
    """One more step under torch.profiler: where its wall time goes. Returns the lines to print: the step's
    wall time, the host's time inside ATen ops (self CPU time summed over ops: dispatch, launches, the CPU's
    kernels), the GPU's kernel time (self device time summed), and the ops that took each longest. Wall time
    past the host's ops is Python's: the sampler's loop, the rewards, the modules' calls."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    device_us = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
    host, gpu = sum(e.self_cpu_time_total for e in events) / 1e6, sum(device_us(e) for e in events) / 1e6
    on_gpu = f", the GPU {gpu * 1e3:.1f} ms in kernels" if cuda else ""
    lines = [f"profile of one bgpo.py step (the profiler's own costs in it): {wall * 1e3:.1f} ms wall, the "
             f"host {host * 1e3:.1f} ms in ATen ops{on_gpu}"]
    for label, key in [("host", lambda e: e.self_cpu_time_total)] + ([("GPU", device_us)] if cuda else []):
        top = sorted(events, key=key, reverse=True)[:6]
        lines.append(f"  longest on the {label}: " + ", ".join(
            f"{e.key[6:]} {key(e) / 1e3:.1f} ms x{e.count}" for e in top))
    return lines

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
    p.add_argument("--mixed", type=float, default=1.0,
                   help="the share of groups whose rewards differ (the others tie; --skip-tied drops them)")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA: bgpo.py's path samples by replaying a CUDA graph of the sampler (lab.graphs)")
    p.add_argument("--cap-gib", type=float, default=None,
                   help="CUDA: cap this process's GPU memory (24: a consumer GPU's budget on a bigger card)")
    p.add_argument("--profile", action="store_true",
                   help="one more step of bgpo.py's path under torch.profiler: the host's time and the GPU's")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"the device's dense bf16 peak for MFU (None: by its name, {PEAK_TFLOPS})")
    bench, rest = p.parse_known_args(argv)   # the rest are bgpo.py's flags, checked by bgpo.parse_args
    if bench.steps < 1 or bench.warmup < 0:
        p.error(f"--steps must be at least 1 and --warmup at least 0, got {bench.steps} and {bench.warmup}")
    for flag, value in (("--cap-gib", bench.cap_gib), ("--peak-tflops", bench.peak_tflops)):
        if value is not None and not value > 0:
            p.error(f"{flag} must be positive, got {value}")
    args = bgpo.parse_args(rest)
    if not 0 < bench.mixed <= 1 or mixed_groups(args, bench.mixed) == 0:
        p.error(f"--mixed must be in (0, 1] and leave a group to update, got {bench.mixed}")
    cuda, task = args.device.startswith("cuda"), get_task(args.task)
    if bench.graphs and (bench.compile or not cuda):
        p.error("--graphs needs a CUDA device and no --compile"
                + ("" if cuda else f", got --device {args.device}"))
    if bench.cap_gib and cuda:
        cap_memory(args.device, bench.cap_gib)
    device = torch.cuda.get_device_name(args.device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    peak = peak_flops(args, bench)
    rows = {path: time_path(task, args, path, bench) for path in ("float32", "bgpo.py")}
    flops, B = rows["bgpo.py"]["flops"], args.group_size * args.prompts_per_step
    print(f"model {rows['bgpo.py']['params'] / 1e6:.2f}M parameters | {task.name}, {B} rollouts, "
          f"{updated_rows(args, bench.mixed)} updated ({bench.mixed:.0%} of the groups mixed, "
          f"--{'' if args.skip_tied else 'no-'}skip-tied), L = {task.gen_len}, n_t {args.mc_samples} | "
          f"{flops / 1e12:.3f} TFLOP a step | {device}, "
          f"PyTorch {torch.__version__} | median of {bench.steps} steps after {bench.warmup}"
          + (f" | memory capped at {bench.cap_gib:g} GiB" if bench.cap_gib and cuda else ""))
    print("  s/step speed-up     MFU act MiB" + (" CUDA peak MiB" if cuda else "")
          + " | ops: sampler update optim. other  total | syncs: sampler update optim. other | path")
    labels = {"float32": "float32, random numbers drawn on the CPU, activation meter, n_t passes, AdamW a "
                         "parameter at a time (before the GPU lines)",
              "bgpo.py": f"bgpo.py: {args.dtype}, --mc-chunk {args.mc_chunk}"
                         + (", TF32, random numbers on the GPU, no meter" if cuda else "")
                         + (", torch.compile" if bench.compile else "")
                         + (", the sampler a CUDA graph" if bench.graphs else "")}
    for path, row in rows.items():
        row["mfu"] = flops / row["s"] / peak if peak else None
        phases = ("sampler", "update", "optimizer", "other")
        ops, syncs = ([row[key].get(phase, 0) for phase in phases] for key in ("ops", "syncs"))
        print(f"{row['s']:8.4f} {rows['float32']['s'] / row['s']:7.2f}x "
              + (f"{row['mfu']:7.1%} " if peak else f"{'-':>7} ") + (f"{row['act_mb']:7.1f}" if row["act_mb"]
                                                                   else f"{'-':>7}")
              + (f" {row['cuda_mb']:13.0f}" if cuda else "")
              + " | " + " ".join(f"{n:>{w}}" for n, w in zip(ops + [sum(ops)], (12, 6, 6, 5, 6)))
              + " | " + " ".join(f"{n if cuda else '-':>{w}}" for n, w in zip(syncs, (14, 6, 6, 5)))
              + f" | {labels[path]}")
    for line in rows["bgpo.py"]["profile"] or []:
        print(line)
    if bench.compile:   # more graphs than the sampler's and the update's: a model that recompiles
        from torch._dynamo.utils import counters
        print(f"torch.compile: {dict(counters['stats'])}")
    return rows

if __name__ == "__main__":
    cli.command_line(main, "python -m lab.bench_step")
