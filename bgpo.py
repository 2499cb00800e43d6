"""
Boundary-Guided Policy Optimization (BGPO; Lin, Zhang, Hou, Li, "... for Memory-efficient RL of Diffusion
Large Language Models", arXiv 2510.11683) for a masked diffusion LM, beside the naive ELBO-based objective it
replaces, and the script that runs them: SFT on demonstrations, then RL with a verifier.

A dLLM has no tractable log pi(y|x), so RL uses its ELBO, estimated with n_t masked copies y_t of each rollout
y (a completion sampled in RL; names as in the README's table). The naive objective exp(mean_j d_j) A couples
the copies through the exp: as one autograd graph it keeps all n_t copies' activations alive. BGPO replaces it
by a lower bound that is a sum over copies: backward runs --mc-chunk copies at a time, in their memory alone.
On-policy (the default) every d_j is 0 and the bound equals the naive objective in value and gradient: BGPO's
update IS the naive gradient, accumulated one masked copy at a time. Off-policy (--minibatches 2) it is a
bound, where a pass without gradients would give the exact naive gradient in the same memory (the lab's
naive_two_pass_backward). Departures from the paper: the README's last section, and where made.

Shapes: B rows of a batch, one rollout each (prompts x G; under torchrun, a process's share), G rollouts per
prompt, M masked copies per completion in a tensor (n_t; in bgpo_backward a chunk of --mc-chunk of them), L
completion length, P prompt length, T = P + L, V vocab.
"""
import argparse
import contextlib
import json
import math
import os
import pathlib
import re
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from tasks import TASKS, encode, get_task
from tiny_dllm import (ActivationMemory, ModelConfig, TinyDLLM, forward_process, generate,
                       masked_log_likelihood, measure_update, out_of_memory, sft_loss)

# 1. The ELBO and its Monte Carlo estimate (Eq. 4-5) ---------------------------------------------------------

@dataclass
class MCSamples:
    """n_t masked copies per completion: mask (B, M, L) bool and weight (B, M), the 1/t factor.
    Drawn once per batch of rollouts and used for both pi_theta and pi_old: d_j compares them on one copy."""
    mask: torch.Tensor
    weight: torch.Tensor

    def __getitem__(self, j):  # copies j (a slice): a chunk for bgpo_backward
        return MCSamples(self.mask[:, j], self.weight[:, j])

    def to(self, device):
        return MCSamples(self.mask.to(device), self.weight.to(device))

def draw_mc_samples(batch_size, gen_len, n_t, generator=None, scheme="stratified"):
    """n_t masked copies per completion, each an unbiased one-copy estimate of the ELBO: the forward
    process of tiny_dllm.py: "stratified" (the default, after LLaDA's: counts k spread over 1..L) or "iid"."""
    return MCSamples(*forward_process(batch_size, gen_len, n_t, generator, scheme))

def elbo_terms(model, prompts, completions, mc):
    """l_j = (1/t_j) sum_{i masked in y_t} log p_theta(y^i | y_t, x), in nats: (B, M).
    All B*M masked copies go through the model as one batch; mean_j l_j estimates the ELBO (Eq. 5)."""
    check_shapes(prompts, completions, mc)
    (B, M), L = mc.weight.shape, completions.shape[1]
    x, y = prompts.repeat_interleave(M, 0), completions.repeat_interleave(M, 0)    # (B*M, P), (B*M, L)
    logp = masked_log_likelihood(model, x, y, mc.mask.reshape(B * M, L).to(y.device))
    return mc.weight.to(logp) * logp.view(B, M)

# 2. The objectives: naive (Eq. 6-7) and BGPO's lower bound (Eq. 9-14), side by side -------------------------

def check_shapes(prompts, completions, mc, old_terms=None, advantages=None):
    """Every shape must match exactly: a silent broadcast would train on the wrong numbers."""
    B, L = prompts.shape[0], completions.shape[-1]
    M = mc.mask.shape[1] if mc.mask.dim() == 3 else -1
    expected = {"prompts": (prompts, (B, prompts.shape[-1])), "completions": (completions, (B, L)),
                "mc.mask": (mc.mask, (B, M, L)), "mc.weight": (mc.weight, (B, M)),
                "old_terms": (old_terms, (B, M)), "advantages": (advantages, (B,))}
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected {shape}, got shape {tuple(tensor.shape)}")
    # NaN: checked on the host's tensors alone, as on a GPU's the host would wait for the device
    if advantages is not None and advantages.device.type == "cpu" and torch.isnan(advantages).any():
        raise ValueError(f"advantages: contains NaN (shape {tuple(advantages.shape)})")

def log_ratio(terms, old_terms, L):
    """d_j = (l_j(theta) - l_j(old)) / L, the per-token log importance ratio on one masked copy (/ L: DARE's,
    not the paper's; it keeps ratios near 1). old_terms None: on-policy, the old terms are these, detached."""
    return (terms - (terms.detach() if old_terms is None else old_terms)) / L

def ppo_clip(ratio, A, clip_eps):
    """ratio * A, or PPO's pessimistic min with it clipped to [1 - eps, 1 + eps]; the ratio is the importance
    ratio's estimate, or in the bound its per-copy stand-in (1 + d_j or e^{d_j})."""
    if clip_eps is None:
        return ratio * A
    return torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)

def naive_objective(d, A, clip_eps=None):
    """R_hat = exp(mean_j d_j) * A per completion (Eq. 7): (B, M) log-ratios -> (B,). exp(mean_j d_j)
    stands in for the per-token importance ratio (pi_theta / pi_old)^(1/L); the exp couples the M copies."""
    return ppo_clip(d.mean(1).exp(), A, clip_eps)

def bgpo_bound(d, A, n_t, clip_eps=None):
    """BGPO's per-copy terms g_j (Eq. 13): (B, M) log-ratios of M of the n_t masked copies -> (B, M),
    with R_lb = sum over all n_t copies of g_j <= R_hat.
      A >= 0: e^m >= 1 + m for m = mean_j d_j (Lemma 1, the tangent at 0), so exp(m) A >= mean(1 + d_j) A.
      A <  0: e^m <= mean e^{d_j} (Lemma 2, Jensen), and A < 0 flips it: exp(m) A >= mean(e^{d_j}) A.
    Both hold with PPO's clip per copy: f(r) = min(r A, clip(r) A) is concave and moves with r as A's sign
    says, so f(e^m) >= f(mean of the copies' terms) >= mean_j f(term j). Both are R_hat when every d_j = 0.
    1 + d is used as is, never as DARE's exp(log(1 + d)), NaN for d < -1 (its gradient NaN at -1)."""
    A = A[:, None]
    positive = A >= 0
    # exp(d) only where A < 0: in float32 exp(d) is inf for d > 88, and torch.where's backward would
    # multiply that inf by 0 (NaN) in the branch it does not take
    per_copy = torch.where(positive, 1 + d, d.masked_fill(positive, 0).exp())
    return ppo_clip(per_copy, A, clip_eps) / n_t

def naive_loss(model, prompts, completions, mc, old_terms, advantages, clip_eps=None):
    """-mean_b R_hat_b as one graph: one forward over all B*M masked copies, whose activations autograd keeps
    until the caller's backward (memory grows with M). The gradient, A exp(mean_j d_j) (1/n_t) sum_j grad d_j,
    could accumulate one copy at a time after a no-grad pass (the lab's naive_two_pass_backward)."""
    check_shapes(prompts, completions, mc, old_terms, advantages)
    terms = elbo_terms(model, prompts, completions, mc)              # (B, M)
    d = log_ratio(terms, old_terms, completions.shape[1])
    return -naive_objective(d, advantages.to(d), clip_eps).mean()

def bgpo_backward(model, prompts, completions, mc, old_terms, advantages, clip_eps=None, mc_chunk=1):
    """-mean_b R_lb_b, backpropagated one chunk of mc_chunk masked copies at a time. R_lb is a sum of per-copy
    terms, so the chunks' gradients add up in .grad (gradient accumulation, as over micro-batches) while one
    chunk's activations are alive: memory is that of mc_chunk copies, whatever n_t is. Returns the loss."""
    check_shapes(prompts, completions, mc, old_terms, advantages)
    if not isinstance(mc_chunk, int) or mc_chunk < 1:
        raise ValueError(f"mc_chunk: must be a positive int, got {mc_chunk!r}")
    n_t, L = mc.weight.shape[1], completions.shape[1]
    total = 0.0
    for j in range(0, n_t, mc_chunk):
        chunk = slice(j, j + mc_chunk)
        terms = elbo_terms(model, prompts, completions, mc[chunk])     # (B, M)
        d = log_ratio(terms, None if old_terms is None else old_terms[:, chunk], L)
        loss = -bgpo_bound(d, advantages.to(d), n_t, clip_eps).sum(1).mean()
        loss.backward()
        total = total + loss.detach()                                 # no host sync per chunk
    return float(total)

def group_advantages(rewards, group_size):
    """A = (r - mean_group r) / (std_group r + 1e-6) (Eq. 18) for (B,) rewards of consecutive groups of
    group_size rollouts, with torch.std's unbiased (n - 1) std as in TRL's GRPO trainer. Ties: A = 0."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected (B,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size: must be an int >= 2 dividing {rewards.shape[0]}, got {group_size!r}")
    r = rewards.view(-1, group_size)
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    # rounding makes mean(0.1, ..., 0.1) != 0.1, and dividing by std + 1e-6 would make that an A of ~1e-2
    tie = r.amax(1, keepdim=True) == r.amin(1, keepdim=True)
    return A.masked_fill(tie, 0.0).flatten()

# 3. The script: SFT on demonstrations, then RL with the verifier --------------------------------------------

DEMOS = {"arithmetic": 750, "countdown": 500, "sudoku": 50}  # default --demos per task
SFT_LR, SFT_BATCH, SFT_PATIENCE = 1e-3, 128, 4   # peak lr (cosine), batch, evaluations without progress
SFT_MIN_STEPS = {"arithmetic": 500, "countdown": 0, "sudoku": 0}   # no stop on a task's early plateau
RL_LR, NEG_WEIGHT, CLIP_EPS = 1e-4, 0.5, 0.2  # constant lr; weight of A < 0 (paper: 1); PPO clip (off-policy)
TEMPERATURE = 1.3  # of the rollouts: more mixed groups than 1.0; evaluation is greedy
SIZES = {"cpu": {}, "gpu": dict(n_layer=6, n_embd=256, demos=2000, prompts_per_step=64, rl_steps=1000,
                                skip_tied=False)}   # --mc-chunk: as many masked copies as the card holds
COPY_GIB = {"bfloat16": 0.6, "float32": 1.06}   # a masked copy's activations in a GPU-size update (measured)

class RunError(ValueError):  """A wrong checkpoint, a diverged run, the GPU's memory: one line, exit code 2"""

def everyone(obj, args):   # data parallel (torchrun): [obj of process 0, obj of process 1, ...] on every one
    gathered = [obj] * args.world
    if args.world > 1:
        dist.all_gather_object(gathered, obj)
    return gathered

def average_gradients(model, args, *stats):
    """Average .grad and stats over the processes: one all_reduce of one flat buffer per mini-batch (DDP,
    unless no_sync, syncs after each backward). A number comes back a number, a tensor a tensor (no wait)."""
    if args.world == 1:
        return list(stats)
    params = list(model.parameters())
    flat = torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten() for p in params]
                     + [torch.as_tensor(s).to(params[0]).view(1) for s in stats])
    dist.all_reduce(flat)   # the sum over processes
    *grads, means = (flat / args.world).split([p.numel() for p in params] + [len(stats)])
    for p, grad in zip(params, grads):
        p.grad = grad.view_as(p)
    return [mean[0] if torch.is_tensor(s) else mean.item() for s, mean in zip(stats, means.split(1))]

def make_model(task, args):   # a model of the flags' size for the task, on --device
    return TinyDLLM(ModelConfig(task.tokenizer.vocab_size, args.n_layer, args.n_head, args.n_embd,
                                task.prompt_len + task.gen_len, task.tokenizer.mask_id)).to(args.device)

def autocast(args):
    """With --dtype bfloat16, nanoGPT's bf16 autocast (logits come back float32). A region casts each weight
    once and reuses the cast, so a region wraps a phase whose weights stay put: never an optimizer step."""
    bf16 = args.dtype == "bfloat16"
    return torch.autocast(args.device.split(":")[0], torch.bfloat16) if bf16 else contextlib.nullcontext()

def test_problems(task, args):
    return task.sample(args.eval_size, "test", 1234)[0]   # the same problems for every evaluation

@torch.no_grad()
def evaluate(model, task, prompts, args, n_show=3):
    """Greedy decoding: solve rate (reward 1), mean reward, solves, n_show lines (a solve first, if any)."""
    mine = prompts[args.rank::args.world]   # data parallel: each process answers its share, then all see all
    batch_size = max(len(mine), 1) if args.device.startswith("cuda") else 256  # CPU: the sizes the README ran
    with autocast(args):
        texts = [task.decode(y) for i in range(0, len(mine), batch_size)
                 for y in generate(model, encode(task, mine[i:i + batch_size], device=args.device),
                                   task.gen_len).cpu()]
    rewards = [task.reward(prompt, text) for prompt, text in zip(mine, texts)]
    prompts, texts, rewards = [sum(share, []) for share in zip(*everyone([mine, texts, rewards], args))]
    solved = [int(r == 1.0) for r in rewards]   # per problem, in order: for paired comparisons
    first = [i for i, s in enumerate(solved) if s][:1]
    shown = sorted(first + [i for i, s in enumerate(solved) if not s][:n_show - len(first)])
    return {"accuracy": sum(solved) / len(solved), "reward": sum(rewards) / len(rewards), "solved": solved,
            "examples": [f"    {prompts[i]} -> {texts[i]} -> reward {rewards[i]:.2f}" for i in shown]}

def paired_gain(before, after):
    """mean_i (after_i - before_i) of 0/1 outcomes on the same problems, paired, and its 95% half-width."""
    d = [a - b for a, b in zip(after, before, strict=True)]
    return statistics.mean(d), 1.96 * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan

def write_text(path, text, save=None):
    """text, or what save(file name) writes, to a temporary file renamed to path: never a broken file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    (save or (lambda tmp: pathlib.Path(tmp).write_text(text)))(path + ".tmp")
    os.replace(path + ".tmp", path)

def save_checkpoint(path, task, config, **state):   # with what load_checkpoint checks
    state = dict(task=task.name, vocab=task.tokenizer.itos, config=asdict(config), **state)
    write_text(path, None, lambda tmp: torch.save(state, tmp))

def load_checkpoint(path, task, config=None):
    """Load a checkpoint, checking that it was made for this task, tokenizer and model config (if given)."""
    if not os.path.isfile(path):
        raise RunError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        made_for = [state["task"], state["vocab"], state["config"] if config else None]
    except Exception as e:
        raise RunError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if made_for != [task.name, task.tokenizer.itos, config and asdict(config)]:
        raise RunError(f"{path} was made for task {made_for[0]!r} and model config {made_for[2]}, not these")
    return state

def load_model(path, task, args):
    model = make_model(task, args)
    model.load_state_dict(load_checkpoint(path, task, model.config)["model"])
    return model

def sft_path(args):
    """The SFT checkpoint's name records every flag that changes the kept model: --stage all reuses it."""
    stop, bf16 = f"p{SFT_PATIENCE}m{SFT_MIN_STEPS[args.task]}", "_bf16" if args.dtype == "bfloat16" else ""
    return os.path.join(args.out_dir, f"sft_{args.task}_demos{args.demos}_{args.sft_steps}x{SFT_BATCH}_lr"
                        f"{SFT_LR:g}_val{args.val_size}e{args.sft_eval_every}{stop}_l{args.n_layer}"
                        f"h{args.n_head}e{args.n_embd}_seed{args.seed}{args.processes}{bf16}.pt")

def sft_batches(task, args, generator):
    """Endless SFT batches (x, y) of SFT_BATCH / world rows, drawn with replacement from --demos (0: new)."""
    n = SFT_BATCH // args.world
    while not args.demos:
        yield encode(task, *task.sample(n, "train", generator), device=args.device)
    x, y = encode(task, *task.sample(args.demos, "train", 10_000 + args.seed), device=args.device)
    while True:
        rows = torch.randint(args.demos, (n,), generator=generator, device=generator.device).to(args.device)
        yield x[rows], y[rows]

def device_noise(args, generator):   # the masks' and sampler's random numbers: on CUDA drawn on the GPU
    cuda = args.device.startswith("cuda")
    return torch.Generator(args.device).manual_seed(generator.initial_seed() + 1) if cuda else generator

def sft_lr_at(args, step):
    """SFT's learning rate at a step: a linear warmup times a cosine decay to 10% over --sft-steps."""
    warmup, progress = min(100, args.sft_steps // 10), min(step - 1, args.sft_steps) / args.sft_steps
    return SFT_LR * min(1.0, step / (warmup + 1)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

def run_sft(args, task):
    """Minimise the demonstrations' negative ELBO (tiny_dllm.sft_loss), keeping the model that validates best;
    stop after SFT_PATIENCE evaluations without progress (and SFT_MIN_STEPS): more SFT memorises the demos."""
    torch.manual_seed(args.seed)  # the initial weights: the same on every process
    model = make_model(task, args)
    print(f"model: {model.num_params():,} parameters, {args.n_layer} layers, n_embd {args.n_embd} | SFT on "
          + (f"{args.demos} demonstrations" if args.demos else "fresh demonstrations every step"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed + 1_000_000 * args.rank)  # a stream per process
    noise = device_noise(args, generator)   # on CUDA the batches' rows and masks are drawn on the GPU
    batches = sft_batches(task, args, noise)
    val_prompts = task.sample(args.val_size, "validation", 4321)[0]   # prompts only: the verifier scores
    best, curve, seconds, losses = None, [], 0.0, []   # seconds: of training, without the evaluations
    for step in tqdm(range(1, args.sft_steps + 1), desc=f"SFT {task.name}", leave=False,
                     disable=args.rank or None):   # rank 0's bar only (None: when on a terminal)
        t0 = time.time()
        for group in optimizer.param_groups:
            group["lr"] = sft_lr_at(args, step)
        with autocast(args):
            loss = sft_loss(model, *next(batches), generator=noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        [loss] = average_gradients(model, args, loss.detach())   # a tensor: no wait for the GPU a step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss)
        seconds += time.time() - t0
        if step % args.sft_eval_every and step < args.sft_steps:
            continue
        val = evaluate(model, task, val_prompts, args)   # the test problems wait for RL step 0
        curve.append({"step": step, "loss": float(sum(losses)) / len(losses), "val_reward": val["reward"],
                      "val_accuracy": val["accuracy"], "seconds": seconds})
        losses, improved = [], best is None or val["reward"] > best["val_reward"]
        if improved:
            best, best_weights = curve[-1], {k: v.clone() for k, v in model.state_dict().items()}
        if args.rank == 0:  # the best model so far and the whole curve: an interrupted SFT keeps them
            save_checkpoint(sft_path(args), task, model.config, stage="sft", step=best["step"],
                            model=best_weights, curve=curve)
        tqdm.write(f"SFT step {step:5d} | loss {curve[-1]['loss']:.4f} | validation reward "
                   f"{val['reward']:.3f} (accuracy {val['accuracy']:5.1%}) | {seconds:.0f} s"
                   + (" | best so far" if improved else ""))
        if step - best["step"] >= SFT_PATIENCE * args.sft_eval_every and step >= SFT_MIN_STEPS[task.name]:
            print(f"SFT stops: no better validation reward for {SFT_PATIENCE} evaluations")
            break
    model.load_state_dict(best_weights)
    print(f"kept the SFT model of step {best['step']} (validation reward {best['val_reward']:.3f}): "
          f"{sft_path(args)}")
    return model

@torch.no_grad()
def sample_rollouts(model, task, prompts, args, generator):
    """A group of G rollouts of each prompt, and the verifier's rewards: x, y, rewards. The sampler (LLaDA's,
    at TEMPERATURE) is not the random-order model at temperature 1 whose likelihood the ELBO bounds."""
    prompts = [p for p in prompts for _ in range(args.group_size)]
    x = encode(task, prompts, device=args.device)
    with autocast(args):
        y = generate(model, x, task.gen_len, temperature=TEMPERATURE, generator=generator)
    return x, y, torch.tensor([task.reward(p, task.decode(ids)) for p, ids in zip(prompts, y.cpu())])

def score_test_problems(model, task, args, record):
    """Greedy answers to the test problems: adds their scores to an RL step's log record; returns text."""
    result = evaluate(model, task, test_problems(task, args), args)
    record.update(accuracy=result["accuracy"], eval_reward=result["reward"])
    return (f"test accuracy {result['accuracy']:.1%} (reward {result['reward']:.3f})\n"
            + "\n".join(result["examples"]))

def rows_to_update(rows, A, x, y, mc, old_terms, args):
    """A mini-batch's rows with signal (A != 0; a group whose rewards tie has A = 0) or all (--no-skip-tied):
    how many have signal, and the update's inputs on the device, A rescaled (bgpo_backward means over rows)"""
    signal = rows[A[rows] != 0]
    kept = signal if args.skip_tied else rows
    # queued, the index too: a host's makes each gather wait (MPS's non-blocking copies can read freed memory)
    to_device = lambda t: t.to(args.device, non_blocking=not args.device.startswith("mps"))
    i, A_kept = to_device(kept), to_device(A[kept] * (len(kept) / len(rows)))
    old_kept = None if old_terms is None else old_terms[i]
    return len(signal), (x[i], y[i], MCSamples(mc.mask[i], mc.weight[i]), old_kept, A_kept)

def run_rl(args, task, model):
    """RL from the SFT model on fresh problems, rewarded by the verifier alone. The loop body is the paper's
    algorithm: rollouts, rewards, advantages, masked copies, update; then the log, tests and checkpoints."""
    G, B, L = args.group_size, args.prompts_per_step // args.world * args.group_size, task.gen_len
    optimizer = torch.optim.AdamW(model.parameters(), lr=RL_LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1 + 1_000_000 * args.rank)  # a stream per process
    noise, cuda = device_noise(args, generator), args.device.startswith("cuda")   # rollouts, masked copies
    run_dir = os.path.join(args.out_dir, args.run_name)
    ckpt_path, log_path = os.path.join(run_dir, "ckpt.pt"), os.path.join(run_dir, "log.jsonl")
    if args.resume:
        state = load_checkpoint(ckpt_path, task, model.config)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rngs = state["rng"][args.rank] if len(state["rng"]) == args.world else None   # generator's, noise's
        if not isinstance(rngs, list) or len(rngs[1]) != len(noise.get_state()):
            raise RunError(f"{ckpt_path} holds the random streams of another device or an older bgpo.py, or "
                           f"of {len(state['rng'])} processes: resume it as it was made")
        for stream, rng in zip((generator, noise), rngs):
            stream.set_state(rng)
        start, records = state["step"] + 1, [json.loads(line) for line in open(log_path)]
        records = [r for r in records if r["step"] < start]  # the log matches the checkpoint
        print(f"resumed {ckpt_path} at step {state['step']}")
    else:
        show_unmasking(model, task, test_problems(task, args)[0], args)
        start, records = 1, [{"step": 0}]
        print("RL step 0 (SFT model): " + score_test_problems(model, task, args, records[0]))
    if args.rank == 0:   # one voice: rank 0 writes the files (whole: the others may be reading the log)
        write_text(log_path, "".join(json.dumps(r) + "\n" for r in records))
        if not args.resume:   # what made the run: the command, its flags, the machine
            write_text(os.path.join(run_dir, "run.json"), json.dumps(dict(command=sys.argv, flags=vars(args),
                       torch=torch.__version__, threads=torch.get_num_threads()), indent=1))
    saved = start - 1
    for step in range(start, args.rl_steps + 1):
        t0 = time.time()
        # 1. fresh training problems, and a group of G rollouts of each from the current policy
        prompts = task.sample(B // G, "train", generator)[0]
        x, y, rewards = sample_rollouts(model, task, prompts, args, noise)           # (B, P), (B, L), (B,)
        # 2. the verifier's rewards -> 3. group-relative advantages (Eq. 18)
        A = group_advantages(rewards, G)                     # (B,), on the CPU as the rewards are
        A = torch.where(A < 0, NEG_WEIGHT * A, A)  # learn more from successes than from failures
        # 4. n_t masked copies of each completion, drawn once: the old and new policy see the same masks
        mc = draw_mc_samples(B, L, args.mc_samples, noise).to(args.device)   # on MPS noise is the CPU's
        old_terms, clip_eps = None, None     # on-policy: the update's own terms, detached (log_ratio)
        if args.minibatches > 1:             # every update after the first is off-policy
            with torch.no_grad(), autocast(args):
                old_terms, clip_eps = elbo_terms(model, x, y, mc), CLIP_EPS                 # (B, M)
        # 5. the update, one per mini-batch of whole groups (one by default)
        losses = []
        with contextlib.nullcontext() if cuda else ActivationMemory(model) as memory:   # CUDA: no hooks' time
            for rows in torch.arange(B).chunk(args.minibatches):
                signal, inputs = rows_to_update(rows, A, x, y, mc, old_terms, args)
                optimizer.zero_grad(set_to_none=True)
                loss = 0.0
                with autocast(args):
                    if signal and args.objective == "bgpo":   # backward per --mc-chunk copies
                        loss = bgpo_backward(model, *inputs, clip_eps, args.mc_chunk)
                    elif signal:                               # one graph over all n_t copies
                        naive = naive_loss(model, *inputs, clip_eps)
                        naive.backward()
                        loss = naive.item()
                loss, mean_rows = average_gradients(model, args, loss, signal)  # means over processes
                if mean_rows == 0:  # no signal in any process: no optimizer step (Adam moves weights on 0)
                    continue
                if not math.isfinite(loss):  # stop before the step: the last checkpoint stays good
                    raise RunError(f"loss is {loss} at RL step {step}; stopped. Last good checkpoint: "
                                   + (f"{ckpt_path} (step {saved})" if saved else "none yet"))
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                losses.append(loss)
        rewards = torch.cat(everyone(rewards, args))   # the log is over every process's rollouts
        groups = rewards.view(-1, G)
        mixed, solve = groups.amax(1) > groups.amin(1), (groups == 1).any(1) & (groups < 1).any(1)
        records.append(r := {"step": step, "seconds": time.time() - t0, "reward": rewards.mean().item(),
                             "reward_std": rewards.std().item(), "mixed_groups": mixed.double().mean().item(),
                             "solve_groups": solve.double().mean().item(),   # a solve and a miss
                             "solved": (rewards == 1.0).double().mean().item(),
                             "loss": sum(losses) / len(losses) if losses else 0.0,
                             "activation_mb": None if cuda else memory.peak / 2**20})   # CUDA: no meter
        line = (f"RL step {step:4d} | reward {r['reward']:.3f} ± {r['reward_std']:.3f} | mixed groups "
                f"{r['mixed_groups']:4.0%} | solved {r['solved']:5.1%} | "
                + ("" if cuda else f"act {r['activation_mb']:.1f} MiB | ") + f"{r['seconds']:.2f} s")
        evaluation = step % args.eval_every == 0 or step == args.rl_steps   # and a checkpoint
        if evaluation:
            line += " | " + score_test_problems(model, task, args, r)
            quiet = 0 if any(q["solve_groups"] for q in records if q["step"] > saved) else step - saved
            rngs, saved = everyone([generator.get_state(), noise.get_state()], args), step   # for --resume
        print(line)
        if evaluation and quiet:   # no RL step since the last evaluation had a solve group
            print(f"warning: no solve group (a solve and a miss: the solves RL reinforces) in the last "
                  f"{quiet} RL steps; {r['solved']:.0%} of this step's rollouts solve"
                  + ("" if r["solved"] >= .5 else ": more SFT (--sft-steps, --demos) or another --seed"))
        if args.rank == 0:   # the log line first, so that a resume from the checkpoint finds it
            with open(log_path, "a") as f:
                f.write(json.dumps(r) + "\n")
            if evaluation:
                save_checkpoint(ckpt_path, task, model.config, stage="rl", step=step,
                                model=model.state_dict(), optimizer=optimizer.state_dict(), rng=rngs)
    return [r for r in records if "accuracy" in r]

def show_unmasking(model, task, prompt, args):
    """Print how the greedy sampler writes one answer, the most confident predictions first; return it."""
    x = encode(task, [prompt], device=args.device)
    with autocast(args):
        y, steps = generate(model, x, task.gen_len, return_steps=True)
    states = "  ".join(task.decode(y[0].masked_fill(steps[0] > s, model.config.mask_id).cpu(), False)
                       for s in range(len(y[0])))
    print(f"how the sampler writes {prompt} (greedy, a token per sampler step, most confident first; _ MASK,"
          f" $ the end):\n" + textwrap.fill(states, 100, initial_indent="    ", subsequent_indent="    "))
    return task.decode(y[0].cpu())

# 4. The memory benchmark: naive vs BGPO as n_t grows, on one RL batch of a real task ------------------------

def bench_memory(args, task):
    """The forward and backward passes of one on-policy update (no optimizer step) of an RL batch with untied
    random rewards, by each objective at n_t = 1..64: rows {"n_t", "naive", "bgpo"} of measure_update."""
    torch.manual_seed(args.seed)
    model, cuda = make_model(task, args), args.device.startswith("cuda")
    B, generator = args.group_size * args.prompts_per_step, torch.Generator().manual_seed(args.seed)
    x, y = encode(task, *task.sample(B, "train", generator), device=args.device)
    A = group_advantages(torch.rand(B, generator=generator), args.group_size).to(args.device)
    print(f"model {model.num_params() / 1e6:.2f}M params | {task.name}, B = {B}, L = {task.gen_len} | BGPO's "
          f"--mc-chunk {args.mc_chunk} | device {args.device} | median of 3 updates\n"
          f" n_t | naive MiB BGPO MiB naive/BGPO | naive s  BGPO s BGPO/naive"
          + (" | CUDA peak MiB:   naive     BGPO" if cuda else ""))
    rows = []
    for n_t in (1, 2, 4, 8, 16, 32, 64):
        mc = draw_mc_samples(B, task.gen_len, n_t, generator).to(args.device)
        with autocast(args):   # the weights do not move: no optimizer step
            naive = measure_update(model, lambda: naive_loss(model, x, y, mc, None, A).backward())
            bgpo = measure_update(model, lambda: bgpo_backward(model, x, y, mc, None, A, None, args.mc_chunk))
        rows.append({"n_t": n_t, "naive": naive, "bgpo": bgpo})
        oom = "".join(f" | {name}: out of memory" for name, m in (("naive", naive), ("BGPO", bgpo)) if not m)
        naive, bgpo = (m or dict.fromkeys(["mb", "s", "cuda_mb"], math.nan) for m in (naive, bgpo))
        print(f"{n_t:>4} | {naive['mb']:>8.1f} {bgpo['mb']:>8.1f} {naive['mb'] / bgpo['mb']:>10.2f} | "
              f"{naive['s']:>7.3f} {bgpo['s']:>7.3f} {bgpo['s'] / naive['s']:>10.2f}"
              + (f" | {naive['cuda_mb']:>22.1f} {bgpo['cuda_mb']:>8.1f}" if cuda else "") + oom)
    return rows

# 5. The command line ----------------------------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, without the usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")

def make_parser(add_help=True):
    p = ArgumentParser(prog="bgpo.py", description="SFT, then BGPO RL of a tiny masked diffusion LM.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, add_help=add_help)
    run, model, sft, rl = (p.add_argument_group(title).add_argument   # --help lists them in groups
                           for title in ("what to run", "the model", "SFT", "RL"))
    run("--task", choices=TASKS, default="countdown", help="the task")
    run("--stage", choices=["sft", "rl", "all"], default="all", help="sft, rl (from SFT's checkpoint), both")
    run("--seed", type=int, default=0, help="seed for weights, data and sampling")
    run("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    run("--size", choices=["auto", *SIZES], default="auto",
        help=f"the defaults below; auto: gpu on a CUDA card that holds it, else cpu; gpu: {SIZES['gpu']}")
    run("--dtype", choices=["float32", "bfloat16"],
        help="forward passes (None: bf16 on CUDA from Ampere on, else float32; TF32 matmuls from Ampere on)")
    run("--out-dir", default="out", help="where checkpoints and logs go")
    run("--run-name", help="the RL run's folder (None: task_objective_ntN[_mbN]_seedN[_gpu][_Nprocesses])")
    run("--resume", action="store_true", help="continue the RL run in --run-name from its last checkpoint")
    run("--overwrite", action="store_true", help="replace the RL run in --run-name if there is one")
    run("--bench-memory", action="store_true", help="the naive vs BGPO memory and time table, then exit")
    run("--prompt", default=None, help='the latest model of the run answers this problem, e.g. "15,4,1:64"')
    model("--n-layer", type=int, default=3, help="transformer blocks")
    model("--n-head", type=int, default=4, help="attention heads")
    model("--n-embd", type=int, default=128, help="embedding width")
    sft("--demos", type=int, help=f"SFT's training problems with answers; 0: fresh each step; None: {DEMOS}")
    sft("--sft-steps", type=int, default=2000, help="most SFT steps; the cosine schedule spans them")
    sft("--sft-eval-every", type=int, default=50, help="SFT steps between validation scores")
    sft("--val-size", type=int, default=200, help="validation problems, to choose the SFT model")
    rl("--objective", choices=["bgpo", "naive"], default="bgpo", help="BGPO's bound or the naive objective")
    rl("--mc-samples", type=int, default=8, help="masked copies n_t per completion (MC samples of the ELBO)")
    rl("--mc-chunk", type=int, default=1, help="masked copies per backward in BGPO (> n_t: all at once)")
    rl("--skip-tied", action=argparse.BooleanOptionalAction, default=True,
       help="leave groups whose rewards tie (A = 0) out of the update: less to compute, a shape that varies")
    rl("--minibatches", type=int, default=1,
       help="updates per batch of rollouts, each on the next share of its groups; 2: the paper's off-policy")
    rl("--rl-steps", type=int, default=200, help="RL steps, one rollout batch each; more on --resume: longer")
    rl("--prompts-per-step", type=int, default=16, help="prompts per RL step")
    rl("--group-size", type=int, default=8, help="rollouts per prompt, G")
    rl("--eval-every", type=int, default=50, help="RL steps between test evaluations and checkpoints")
    rl("--eval-size", type=int, default=1000, help="test problems: one seeded draw from the test split")
    return p

def check_args(p, args):
    """Check the flags (p.error: one line, exit code 2) and fill in what they leave to be derived."""
    for name, value in vars(args).items():   # every integer flag but --seed counts something
        least = {"seed": -math.inf, "demos": 0, "group_size": 2}.get(name, 1)   # --group-size: A compares
        if type(value) is int and value < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    args.rank, args.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # torchrun's
    args.processes = f"_{args.world}processes" if args.world > 1 else ""   # other draws: other files
    args.demos = DEMOS[args.task] if args.demos is None else args.demos
    mb = f"_mb{args.minibatches}" if args.minibatches > 1 else ""
    args.run_name = args.run_name or f"{args.task}_{args.objective}_nt{args.mc_samples}{mb}_seed{args.seed}" \
        + ("_gpu" if args.size == "gpu" else "") + args.processes
    task, ckpt = get_task(args.task), os.path.join(args.out_dir, args.run_name, "ckpt.pt")
    if args.n_embd % args.n_head:
        p.error(f"--n-head {args.n_head} must divide --n-embd {args.n_embd}")
    if args.mc_chunk > 1 and args.objective != "bgpo":
        p.error("--mc-chunk is an option of --objective bgpo")
    if args.prompts_per_step % (args.world * args.minibatches):
        p.error((f"{args.world} processes x " if args.world > 1 else "") + f"--minibatches {args.minibatches}"
                f" must divide --prompts-per-step {args.prompts_per_step} (whole groups each)")
    if SFT_BATCH % args.world:
        p.error(f"{args.world} processes must divide the SFT batch of {SFT_BATCH}")
    if args.resume and (args.stage == "sft" or args.overwrite):
        p.error("--resume continues an RL run: use it with --stage rl or all, without --overwrite")
    if args.resume and not os.path.isfile(ckpt):
        p.error(f"--resume: no run to resume at {ckpt}")
    if args.prompt is not None and not re.fullmatch(task.prompt_pattern, args.prompt):
        p.error(f"--prompt {args.prompt!r}: not a {args.task} problem like {task.sample(1, 'test', 0)[0][0]}")
    return args

def pick_device(p, device):
    """--device auto: CUDA, then Apple's MPS, then the CPU; under torchrun a process's own GPU, or the CPU.
    Returns it and its CUDA cards: under torchrun every process's here, so all decide alike. A card without
    kernels in this PyTorch (sm_XY's run on X.Y to X.9) passes torch.empty: its capability is checked."""
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    device = ("cuda" if cuda else "mps" if mps else "cpu") if device == "auto" else device
    torchrun = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if torchrun:   # each process on its own GPU (NCCL), or on the CPU (gloo)
        device = f"cuda:{os.environ['LOCAL_RANK']}" if device.startswith("cuda") else "cpu"
    try:   # an unknown name, a CUDA index past the last GPU, a build without CUDA: not available
        indexes = range(int(os.environ.get("LOCAL_WORLD_SIZE", 1))) if torchrun else [device]
        cards = [torch.cuda.get_device_properties(i) for i in indexes] if device.startswith("cuda") else []
        built = [divmod(int(arch.split("_")[1].rstrip("af")), 10) for arch in torch.cuda.get_arch_list()]
        for c in (k for k in cards if built and not any(x == k.major and y <= k.minor for x, y in built)):
            p.error(f"the {c.name} (compute capability {c.major}.{c.minor}) has no kernels in this PyTorch;"
                    " its CUDA 12.6 build has: pip install torch -i https://download.pytorch.org/whl/cu126")
        torch.empty(0, device=device)
    except Exception:
        p.error(f"--device {device} is not available here")
    return device, cards

def parse_args(argv=None):
    """The flags, and where one is not given the default the device sets: --dtype bf16 on cards with bf16
    tensor cores (Ampere on), else float32; BGPO's --mc-chunk, the most masked copies (8, 4, 2, 1) whose
    activations fit in half the card's memory; --size auto: the GPU size on a card holding one, else CPU's."""
    p = make_parser()
    given = make_parser(add_help=False).parse_known_args(argv)[0]   # --help shows the device's defaults
    device, cards = pick_device(p, given.device)
    card = min(cards, key=lambda card: card.total_memory, default=None)   # under torchrun: the least memory
    dtype = given.dtype or ("bfloat16" if cards and min(card.major for card in cards) >= 8 else "float32")
    gib = card.total_memory / 2**30 if card else 0.0
    chunk = next((c for c in (8, 4, 2, 1) if c * COPY_GIB[dtype] <= gib / 2), 0)   # 0: no card holds one
    size = given.size if given.size != "auto" else "gpu" if chunk else "cpu"
    why = (f"{card.name}, {gib:.0f} GiB, {dtype}: " + (f"--mc-chunk {chunk}" if chunk else "too small a card")
           if card else f"--device {device}" if torch.cuda.is_available() else "no CUDA device")
    p.set_defaults(**SIZES[size], dtype=dtype, mc_chunk=chunk if given.objective == "bgpo" and chunk else 1)
    args = p.parse_args(argv)
    args.device, args.size, args.size_auto = device, size, f" (--size auto: {why})" * (given.size == "auto")
    return check_args(p, args)

def sft_model(args, task):
    """The SFT model: trained now (--stage sft, or --stage all without a matching checkpoint), else loaded."""
    if args.stage == "sft" or (args.stage == "all" and not os.path.isfile(sft_path(args))):
        return run_sft(args, task)
    print(f"loading the SFT model {sft_path(args)}")
    return load_model(sft_path(args), task, args)

NOT_RESULTS = ("stage", "device", "out_dir", "run_name", "resume", "overwrite", "bench_memory", "prompt",
               "mc_chunk")   # flags that change no number of a run (--mc-chunk: only float rounding)

def refuse_to_overwrite(args):
    """A folder holding a run is continued (--resume, with its run.json's flags but NOT_RESULTS; a larger
    --rl-steps runs longer) or replaced (--overwrite: its checkpoint goes now), never silently reused."""
    run_dir = os.path.join(args.out_dir, args.run_name)
    record, ckpt = os.path.join(run_dir, "run.json"), os.path.join(run_dir, "ckpt.pt")
    if args.overwrite and args.stage != "sft" and args.rank == 0 and os.path.isfile(ckpt):
        os.remove(ckpt)
    if args.stage == "sft" or args.overwrite or not os.path.isfile(os.path.join(run_dir, "log.jsonl")):
        return
    made = json.load(open(record))["flags"] if os.path.isfile(record) else {}
    mutable = NOT_RESULTS + (("rl_steps",) if args.resume else ())   # a resumed run may run longer
    differ = [f"--{name.replace('_', '-')} {made[name]} (now {getattr(args, name)})"
              for name in sorted(set(vars(make_parser().parse_args([]))) - set(mutable))
              if name in made and made[name] != getattr(args, name)]
    if differ or not args.resume:   # a resume may change what NOT_RESULTS names, --mc-chunk included
        raise RunError(f"{run_dir} holds a run" + (f" made with {', '.join(differ)}" if differ else "")
                       + ": " + ("--resume with its flags continues it, " if os.path.isfile(ckpt) else "")
                       + "another --run-name starts a new one, --overwrite replaces it")

def main(argv=None):
    args = parse_args(argv)
    if args.world > 1:  # under torchrun; after every check of the flags, so that a bad one never hangs
        if args.device.startswith("cuda"):
            torch.cuda.set_device(args.device)   # NCCL's collectives work on the current device
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        sys.stdout = sys.stdout if args.rank == 0 else open(os.devnull, "w")   # one voice (errors: every one)
    # CUDA: TF32 matmuls (cards from Ampere on) and bf16 autocast (autocast(args)), as nanoGPT's train.py
    torch.set_float32_matmul_precision("high" if args.device.startswith("cuda") else "highest")
    task, t0 = get_task(args.task), time.time()
    if args.bench_memory:   # what the flags ask for: the memory table, an answer to --prompt, or SFT then RL
        return bench_memory(args, task)
    ckpt = os.path.join(args.out_dir, args.run_name, "ckpt.pt")
    if args.prompt is not None:  # the latest model of the run that the flags name: RL's, else SFT's
        path = ckpt if os.path.isfile(ckpt) else sft_path(args)
        answer = show_unmasking(load_model(path, task, args), task, args.prompt, args)
        print(f"{args.prompt} -> {answer} -> reward {task.reward(args.prompt, answer):.2f} ({path})")
        return answer
    # every progress line reaches a log file as it is printed (a notebook's stdout has no reconfigure)
    getattr(sys.stdout, "reconfigure", lambda **_: None)(line_buffering=True)
    print(f"task {task.name} | device {args.device} | seed {args.seed} | size {args.size}{args.size_auto}"
          + (f" | {args.world} processes, data parallel" if args.world > 1 else ""))
    refuse_to_overwrite(args)
    model = make_model(task, args) if args.resume else sft_model(args, task)  # --resume: run_rl loads weights
    if args.stage == "sft":
        return model
    try:
        history = run_rl(args, task, model)   # its records with a test evaluation (step 0: SFT's)
    except RuntimeError as e:   # out of memory: the remedies that work from where the run stopped
        if not out_of_memory(e):
            raise
        again = "--resume" if os.path.isfile(ckpt) else "--overwrite"   # no checkpoint yet: start it again
        less = f"{again} --mc-chunk {args.mc_chunk // 2} uses less memory, or " if args.mc_chunk > 1 else ""
        smaller = "--size cpu runs the CPU size" if args.size == "gpu" else "--device cpu runs it on the CPU"
        raise RunError(f"out of GPU memory: {less}{smaller}") from None
    before, after = (evaluate(m, task, test_problems(task, args), args, n_show=0)["solved"]   # per problem
                     for m in (load_model(sft_path(args), task, args), model))
    gain, half = paired_gain(before, after)
    print(f"\ntest accuracy {sum(before) / len(before):.1%} -> {sum(after) / len(after):.1%} after "
          f"{history[-1]['step']} RL steps: {100 * gain:+.1f} points, 95% interval "
          f"[{100 * (gain - half):+.1f}, {100 * (gain + half):+.1f}] on {len(after)} test problems\n"
          f"({args.run_name}: {time.time() - t0:.0f} s on {args.device}"
          + (f", CUDA peak {torch.cuda.max_memory_allocated(args.device) / 2**20:,.0f} MiB" if
             args.device.startswith("cuda") else "") + ")\n"
          f"files: {sft_path(args)}, {os.path.join(args.out_dir, args.run_name)}/{{ckpt.pt,log.jsonl}}")
    return history

if __name__ == "__main__":
    code = 0
    try:
        main()
    except (RunError, RuntimeError) as e:   # out of memory outside RL's steps: either remedy
        if not (isinstance(e, RunError) or out_of_memory(e)):
            raise
        message = e if isinstance(e, RunError) else "out of GPU memory: --size cpu, or --device cpu"
        print(f"bgpo.py: error: {message}", file=sys.stderr)
        code = 2
    if dist.is_initialized():   # leave together (on gloo one leaving while rank 0 writes can abort it), but
        if code == 0:           # not after an error: the others may be in a collective (torchrun stops them)
            dist.barrier()
        dist.destroy_process_group()
    sys.exit(code)
