"""
Boundary-Guided Policy Optimization (BGPO) for a masked diffusion LM, beside the naive ELBO-based
objective it replaces, and the pipeline that runs them: SFT on demonstrations, then RL with a verifier.
Paper: Lin, Zhang, Hou, Li, "Boundary-Guided Policy Optimization for Memory-efficient RL of Diffusion
Large Language Models", arXiv 2510.11683.

What BGPO is, once the pieces are laid out. A dLLM has no tractable log pi(y|x), so RL uses its ELBO,
estimated with n_t masked copies of each completion. The naive objective exp(mean_j d_j) A couples the
n_t copies through the exp; computed as one autograd graph it keeps all n_t graphs alive. BGPO replaces
it by a lower bound that is a sum over copies, so backward runs one copy at a time and memory is that of
one copy. On-policy (this file's default, and the paper's main setting) every d_j is 0, the bound equals
the naive objective in value and gradient, and BGPO is the naive gradient accumulated one MC sample at a
time. Off-policy (--minibatches 2, the paper's variant: the second mini-batch's update comes after the
first's) the two differ: BGPO optimises the bound, while a no-grad pass over the copies gives the exact
naive gradient in the same memory, at the cost of that extra forward pass (lab/objectives.py:
naive_two_pass_backward).

The file, in reading order:
1. The ELBO and its Monte Carlo estimate (Eq. 4-5).
2. The naive objective (Eq. 6-7) and BGPO's bound (Eq. 9-14) side by side; group advantages (Eq. 18).
3. Activation memory: ActivationMemory counts the bytes autograd saves for backward.
4. The pipeline: SFT on a few hundred demonstrations, keeping the model with the best validation
   reward; then RL on fresh problems with only the verifier (run_rl: rollouts, rewards, advantages,
   MC draws, update).
5. The memory benchmark (--bench-memory), the paper's Fig. 1 in small. 6. The command line.
7. The exact ELBO and the random-order likelihood by enumeration, for the tests and the lab.

Simplifications versus the paper:
1. A 0.6M-parameter model trained from scratch on toy tasks instead of LLaDA-8B-Instruct.
2. The log-ratio d_j is divided by the completion length L, as DARE's public re-implementation of BGPO
   does (it divides each l_j by the padded response length); the paper's text does not. On-policy this
   only rescales the gradient; off-policy it keeps ratios near 1.
3. No KL term and one update per rollout batch by default, as in the paper's main runs.
4. Group advantages use the unbiased (n-1) standard deviation, torch.std's default (as in TRL's
   GRPO trainer), and a group whose rewards are all equal gets exactly 0.
5. Negative advantages are scaled by --neg-weight (0.5 by default; the paper's is 1).

Shapes: B batch (= prompts x G), G group size, M Monte Carlo samples (n_t, or a chunk of them),
L completion length, P prompt length, T = P + L, V vocabulary, N rows of any other table (encoded
strings, the 2^L - 1 mask sets of section 7).
"""
import argparse
import json
import math
import os
import statistics
import sys
import textwrap
import time
import weakref
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from tasks import TASKS, get_task
from tiny_dllm import ModelConfig, TinyDLLM, forward_process, generate, masked_log_likelihood, sft_loss

# -----------------------------------------------------------------------------
# 1. The ELBO and its Monte Carlo estimate (Eq. 4-5)

@dataclass
class MCSamples:
    """n_t masked copies per sequence: mask (B, M, L) bool and weight (B, M), the 1/t factor.
    Drawn once per rollout batch and used for both pi_theta and pi_old (coupling)."""
    mask: torch.Tensor
    weight: torch.Tensor

    def __getitem__(self, j):  # samples j (a slice): a chunk for bgpo_backward
        return MCSamples(self.mask[:, j], self.weight[:, j])

    def to(self, device):
        return MCSamples(self.mask.to(device), self.weight.to(device))

def draw_mc_samples(batch_size, gen_len, n_t, generator=None, scheme="stratified"):
    """n_t masked copies per sequence, each an unbiased one-sample estimate of the ELBO: the forward
    process of tiny_dllm.py, "stratified" (LLaDA's, the default: mask counts spread over 1..L) or "iid"."""
    return MCSamples(*forward_process(batch_size, gen_len, n_t, generator, scheme))

def elbo_terms(model, prompts, completions, mc):
    """l_j = (1/t_j) sum_{i masked in y_t} log p_theta(y^i | y_t, x), in nats: (B, M).
    All B*M masked copies go through the model as one batch; mean_j l_j estimates the ELBO (Eq. 5)."""
    check_shapes(prompts, completions, mc)
    (B, M), L = mc.weight.shape, completions.shape[1]
    x, y = prompts.repeat_interleave(M, 0), completions.repeat_interleave(M, 0)    # (B*M, P), (B*M, L)
    logp = masked_log_likelihood(model, x, y, mc.mask.reshape(B * M, L).to(y.device))
    return mc.weight.to(logp) * logp.view(B, M)

# -----------------------------------------------------------------------------
# 2. The objectives: naive (Eq. 6-7) and BGPO's lower bound (Eq. 9-14), side by side

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
    if advantages is not None and torch.isnan(advantages).any():
        raise ValueError(f"advantages: contains NaN (shape {tuple(advantages.shape)})")

def log_ratio(terms, old_terms, L):
    """d_j = (l_j(theta) - l_j(old)) / L, the per-token log-ratio on the same masked copy. old_terms None
    means on-policy: the old policy is the current one, so its terms are these terms, detached (d = 0,
    the gradient is that of l_j / L), and no extra forward pass is needed to compute them."""
    return (terms - (terms.detach() if old_terms is None else old_terms)) / L

def ppo_clip(ratio, A, clip_eps):
    """ratio * A, or PPO's pessimistic min with the ratio clipped to [1 - eps, 1 + eps]."""
    if clip_eps is None:
        return ratio * A
    return torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)

def naive_objective(d, A, clip_eps=None):
    """R_hat = exp(mean_j d_j) * A per sequence (Eq. 7): (B, M) log-ratios -> (B,). exp(mean_j d_j)
    estimates the importance ratio (pi_theta / pi_old)^(1/L) by the ELBO's difference; the exp couples
    the M samples, so no sample's term is a function of that sample alone."""
    return ppo_clip(d.mean(1).exp(), A, clip_eps)

def bgpo_bound(d, A, n_t, clip_eps=None):
    """BGPO's per-sample terms g_j (Eq. 13): (B, M) log-ratios of M of the n_t samples -> (B, M),
    with R_lb = sum over all n_t samples of g_j <= R_hat.
      A >= 0: e^u >= 1 + u (Lemma 1, the tangent at 0), so exp(mean d) A >= mean(1 + d_j) A.
      A <  0: e^{mean u} <= mean e^{u_j} (Lemma 2, Jensen), and A < 0 flips it:
              exp(mean d) A >= mean(e^{d_j}) A.
    Both hold with PPO's clip applied per sample too (the clipped objective is concave and monotone
    in the ratio). Both equal R_hat when every d_j = 0, i.e. on-policy. 1 + d is used as is, never as
    exp(log(1 + d)) (DARE's form), which is NaN for d <= -1."""
    A = A[:, None]
    positive = A >= 0
    per_sample = torch.where(positive, 1 + d, d.masked_fill(positive, 0).exp())  # no exp where unused
    return ppo_clip(per_sample, A, clip_eps) / n_t

def naive_loss(model, prompts, completions, mc, old_terms, advantages, clip_eps=None):
    """-mean_b R_hat_b, as one graph: one forward over all B*M masked copies, and until the caller calls
    backward autograd keeps the activations of all M samples, so memory grows with M. (That is a property
    of this one-graph computation, not of the gradient: grad R_hat = A exp(mean_j d_j) (1/n_t) sum_j
    grad d_j, so a no-grad pass giving each sequence's A exp(mean_j d_j) / n_t lets the same gradient be
    accumulated one sample at a time: the lab's naive_two_pass_backward.)"""
    check_shapes(prompts, completions, mc, old_terms, advantages)
    terms = elbo_terms(model, prompts, completions, mc)              # (B, M)
    d = log_ratio(terms, old_terms, completions.shape[1])
    return -naive_objective(d, advantages.to(d), clip_eps).mean()

def bgpo_backward(model, prompts, completions, mc, old_terms, advantages, clip_eps=None, mc_chunk=1):
    """-mean_b R_lb_b, backpropagated one chunk of mc_chunk samples at a time. R_lb is a sum of
    per-sample terms, so the chunks' gradients add up in .grad to the full gradient while only one
    chunk's activations are alive: memory is that of mc_chunk samples, whatever n_t is. This is
    gradient accumulation, as over micro-batches, here over MC samples. Returns the loss."""
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
        total = total + loss.detach()                                 # no host sync per sample
    return float(total)

def reward_groups(rewards, group_size):
    """(B,) rewards laid out as consecutive groups of group_size completions of the same prompt ->
    (B / group_size, group_size), after checking that they are."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected (B,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size: must be an int >= 2 dividing {rewards.shape[0]}, got {group_size!r}")
    return rewards.view(-1, group_size)

def group_advantages(rewards, group_size):
    """A = (r - mean_group r) / (std_group r + 1e-6) (Eq. 18). Equal rewards give A = 0."""
    r = reward_groups(rewards, group_size)
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    # rounding makes mean(0.1, ..., 0.1) != 0.1, and dividing by std + 1e-6 would blow that up
    tie = r.amax(1, keepdim=True) == r.amin(1, keepdim=True)
    return A.masked_fill(tie, 0.0).flatten()

# -----------------------------------------------------------------------------
# 3. Activation memory: the bytes autograd holds for backward

class ActivationMemory(torch.autograd.graph.saved_tensors_hooks):
    """While active (a with block), counts the peak bytes of distinct tensors saved for backward,
    excluding the parameters. Each saved tensor is wrapped in a handle whose destruction (when
    backward frees the graph) releases its bytes, so the count is exact and deterministic on CPU."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live, self.current, self.peak = {}, 0, 0   # live: storage -> [bytes, handles alive]
        super().__init__(self._pack, lambda h: h.t if isinstance(h, _Saved) else h)

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return t
        if ptr not in self.live:
            self.live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.current += self.live[ptr][0]
            self.peak = max(self.peak, self.current)
        self.live[ptr][1] += 1
        handle = _Saved(t)
        weakref.finalize(handle, self._release, ptr)
        return handle

    def _release(self, ptr):
        self.live[ptr][1] -= 1
        if self.live[ptr][1] == 0:
            self.current -= self.live.pop(ptr)[0]

    def __enter__(self):
        super().__enter__()
        return self

class _Saved:  # a handle whose garbage collection tells us autograd let go of the tensor
    def __init__(self, t):
        self.t = t

# -----------------------------------------------------------------------------
# 4. The pipeline: SFT on demonstrations, then RL with the verifier

DEMOS = {"arithmetic": 500, "countdown": 500, "sudoku": 200}  # default --demos per task

class RunError(ValueError):  # bad input, a bad checkpoint or a diverged run: one line, exit code 2
    pass

def encode(task, prompts, answers=None, device="cpu"):
    """Prompt strings -> (N, P) tokens; answers, if given, -> (N, L) completions ending in EOS."""
    x = task.tokenizer.encode_batch(prompts, task.prompt_len, "left").to(device)
    if answers is None:
        return x
    return x, task.tokenizer.encode_batch(answers, task.gen_len, "right").to(device)

def make_model(task, args):
    config = ModelConfig(vocab_size=task.tokenizer.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                         n_embd=args.n_embd, max_len=task.prompt_len + task.gen_len,
                         mask_id=task.tokenizer.mask_id)
    return TinyDLLM(config)

def held_out(task, args):
    return task.sample(args.eval_size, "test", 1234)[0]   # the same problems for every evaluation

def validation(task, args):
    return task.sample(args.val_size, "validation", 4321)[0]   # prompts only: the verifier scores them

@torch.no_grad()
def evaluate(model, task, prompts, args, n_show=3):
    """Greedy decoding: exact-solve rate (reward 1), mean reward, and n_show prompt -> completion lines:
    the first solved problem, if any, and the first unsolved ones."""
    batch_size = len(prompts) if args.device.startswith("cuda") else 256  # CPU: the sizes the README ran
    rewards, texts = [], []
    for i in range(0, len(prompts), batch_size):
        y = generate(model, encode(task, prompts[i:i + batch_size], device=args.device), task.gen_len,
                     steps=args.gen_steps, block_len=args.block_len, temperature=0.0)
        texts += map(task.decode, y.cpu())
    rewards = [task.reward(prompt, text) for prompt, text in zip(prompts, texts)]
    solved = [i for i, r in enumerate(rewards) if r == 1.0][:1]
    shown = sorted(solved + [i for i, r in enumerate(rewards) if r < 1.0][:n_show - len(solved)])
    examples = [f"    {prompts[i]} -> {texts[i]} -> reward {rewards[i]:.2f}" for i in shown[:n_show]]
    return {"accuracy": sum(r == 1.0 for r in rewards) / len(rewards), "reward": sum(rewards) / len(rewards),
            "examples": examples}

def save_checkpoint(path, **state):
    """Write to a temporary file, then rename: an interrupted save never leaves a broken file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)

def load_checkpoint(path, task, config=None):
    """Load and check that a checkpoint was made for this task, tokenizer and model config."""
    if not os.path.isfile(path):
        raise RunError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        made_for = (state["task"], state["vocab"], state["config"])
    except Exception as e:
        raise RunError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
    if made_for[0] != task.name:
        raise RunError(f"{path} was made for task {made_for[0]!r}, not {task.name!r}")
    if made_for[1] != task.tokenizer.itos:
        raise RunError(f"{path} was made with another tokenizer")
    if config is not None and made_for[2] != asdict(config):
        changed = {k: v for k, v in made_for[2].items() if asdict(config).get(k) != v}
        raise RunError(f"{path} was made for another model config: {changed}")
    return state

def sft_path(args):
    """The SFT checkpoint's name records every setting that changes it, so a matching one is reused."""
    name = (f"sft_{args.task}_demos{args.demos}_{args.sft_steps}x{args.batch_size}_lr{args.sft_lr:g}"
            f"_val{args.val_size}e{args.sft_eval_every}p{args.sft_patience}"
            f"_l{args.n_layer}h{args.n_head}e{args.n_embd}_seed{args.seed}.pt")
    return os.path.join(args.out_dir, name)

def load_model(path, task, args):
    model = make_model(task, args)
    model.load_state_dict(load_checkpoint(path, task, model.config)["model"])
    return model.to(args.device)

def sft_model(args, task):
    """The SFT model: trained now (--stage sft, or --stage all without a matching checkpoint), else loaded."""
    if args.stage == "sft" or (args.stage == "all" and not os.path.isfile(sft_path(args))):
        return run_sft(args, task)
    model = load_model(sft_path(args), task, args)
    print(f"loaded the SFT model from {sft_path(args)} ({model.num_params():,} parameters)")
    return model

def demonstrations(task, args):
    """SFT's data: --demos training problems with their reference answers, drawn once from the seed
    (the same set on every run and resume), or, with --demos 0, fresh ones at every step."""
    return task.sample(args.demos, "train", 10_000 + args.seed) if args.demos else None

def sft_batches(task, args, generator):
    """An endless stream of (x, y) SFT batches: random draws from the demonstrations, or fresh problems."""
    demos = demonstrations(task, args)
    if demos is None:
        while True:
            yield encode(task, *task.sample(args.batch_size, "train", generator), device=args.device)
    x, y = encode(task, *demos, device=args.device)
    while True:
        rows = torch.randint(len(demos[0]), (args.batch_size,), generator=generator).to(args.device)
        yield x[rows], y[rows]

def sft_lr_at(args, step):
    """SFT's learning rate at a step: linear warmup, then cosine decay to 10% over --sft-steps."""
    warmup = min(100, args.sft_steps // 10)
    progress = min(step - 1, args.sft_steps) / args.sft_steps
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return args.sft_lr * min(1.0, step / (warmup + 1)) * cosine

def sft_step(model, optimizer, x, y, lr, generator):
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = sft_loss(model, x, y, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()

def run_sft(args, task):
    """Minimise the negative ELBO of the demonstrations (tiny_dllm.sft_loss). Every --sft-eval-every
    steps, greedy answers to the validation problems are scored by the verifier (no answers needed);
    the model with the best validation reward is kept, and SFT stops once it has not improved for
    --sft-patience evaluations: more SFT on a few hundred demonstrations memorises them."""
    torch.manual_seed(args.seed)  # the initial weights
    model = make_model(task, args).to(args.device)
    data = f"{args.demos} demonstrations" if args.demos else "fresh demonstrations every step"
    print(f"model: {model.num_params():,} parameters, {args.n_layer} layers, n_embd {args.n_embd} | "
          f"SFT on {data}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    batches = sft_batches(task, args, generator)
    val_prompts, test_prompts = validation(task, args), held_out(task, args)
    best, curve, seconds, losses = None, [], 0.0, []   # seconds: of training, without the evaluations
    steps = range(1, args.sft_steps + 1)
    for step in tqdm(steps, desc=f"SFT {task.name}", leave=False, disable=None):  # a bar on a terminal only
        t0 = time.time()
        losses.append(sft_step(model, optimizer, *next(batches), sft_lr_at(args, step), generator))
        seconds += time.time() - t0
        if step % args.sft_eval_every and step < args.sft_steps:
            continue
        val, test = evaluate(model, task, val_prompts, args), evaluate(model, task, test_prompts, args)
        curve.append({"step": step, "loss": sum(losses) / len(losses), "val_reward": val["reward"],
                      "val_accuracy": val["accuracy"], "accuracy": test["accuracy"], "reward": test["reward"],
                      "seconds": seconds})
        losses, improved = [], best is None or val["reward"] > best["val_reward"]
        if improved:
            best = curve[-1]
            save_checkpoint(sft_path(args), stage="sft", task=task.name, vocab=task.tokenizer.itos,
                            config=asdict(model.config), step=step, model=model.state_dict(), curve=curve)
        tqdm.write(f"SFT step {step:5d} | loss {curve[-1]['loss']:.4f} | validation reward "
                   f"{val['reward']:.3f} (accuracy {val['accuracy']:5.1%}) | held-out accuracy "
                   f"{test['accuracy']:5.1%} | {seconds:.0f} s" + (" | best so far" if improved else ""))
        if step - best["step"] >= args.sft_patience * args.sft_eval_every:
            print(f"SFT stops: no better validation reward for {args.sft_patience} evaluations")
            break
    state = load_checkpoint(sft_path(args), task, model.config)
    state["curve"] = curve  # the whole curve, also the evaluations after the best one
    save_checkpoint(sft_path(args), **state)
    model.load_state_dict(state["model"])
    print(f"kept the SFT model of step {best['step']} (validation reward {best['val_reward']:.3f}, "
          f"held-out accuracy {best['accuracy']:.1%}): {sft_path(args)}")
    return model

@dataclass
class Rollouts:
    """B = prompts x G completions from the policy, with what the sampler and the verifier said."""
    prompts: list               # B prompt strings, each repeated G times in a row
    x: torch.Tensor             # (B, P) prompt tokens
    y: torch.Tensor             # (B, L) completions
    commit_steps: torch.Tensor  # (B, L) the sampler step that wrote each token
    texts: list                 # B decoded completions
    rewards: torch.Tensor       # (B,)

@torch.no_grad()
def sample_rollouts(model, task, prompts, group_size, args, generator, sampler=generate):
    """G completions of each prompt from the current policy at --temperature, and the verifier's rewards.
    sampler: tiny_dllm.generate, or a function with its signature (the lab's samplers)."""
    prompts = [p for p in prompts for _ in range(group_size)]
    x = encode(task, prompts, device=args.device)
    y, commit_steps = sampler(model, x, task.gen_len, steps=args.gen_steps, block_len=args.block_len,
                              temperature=args.temperature, generator=generator, return_steps=True)
    texts = [task.decode(ids) for ids in y.cpu()]
    rewards = torch.tensor([task.reward(p, t) for p, t in zip(prompts, texts)])
    return Rollouts(prompts, x, y, commit_steps, texts, rewards)

def rl_backward(model, batch, mc, old_terms, A, args, rows=None):
    """--objective's loss on the rollout batch's rows (a (B,) bool mask: one mini-batch; None: all of
    them), backpropagated into .grad; returns its value."""
    rows = torch.ones_like(A, dtype=torch.bool) if rows is None else rows
    # A row with A = 0 (its group's rewards all tie) adds nothing but forward passes: drop it, and scale
    # the others' A by their share of the rows, so the mean over the rows stays the same.
    keep = rows & (A != 0)
    A = A[keep] * (int(keep.sum()) / int(rows.sum()))
    x, y, mc = batch.x[keep], batch.y[keep], MCSamples(mc.mask[keep], mc.weight[keep])
    old_terms = None if old_terms is None else old_terms[keep]
    clip_eps = args.clip_eps if off_policy(args) else None   # on-policy the clip is inactive
    if args.objective == "bgpo":
        return bgpo_backward(model, x, y, mc, old_terms, A, clip_eps, args.mc_chunk)
    loss = naive_loss(model, x, y, mc, old_terms, A, clip_eps)
    loss.backward()
    return loss.item()

def off_policy(args):
    """Whether some update of a rollout batch comes after another: then the policy that sampled it is
    no longer the current one, and the update needs its terms (old_terms) and the PPO clip."""
    return args.updates_per_batch > 1 or args.minibatches > 1

def run_rl(args, task, model):
    """RL from the SFT model on fresh training problems, rewarded by the verifier (never their answers).
    One step is the paper's algorithm: rollouts, rewards, advantages, MC draws, update."""
    G, B, L = args.group_size, args.prompts_per_step * args.group_size, task.gen_len
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    log = RLLog(args, task, model, optimizer, generator)   # resumes, or evaluates the SFT model as step 0
    for step in range(log.start, args.rl_steps + 1):
        t0 = time.time()
        # 1. fresh training problems, and G completions of each from the current policy
        prompts = task.sample(args.prompts_per_step, "train", generator)[0]
        batch = sample_rollouts(model, task, prompts, G, args, generator)
        # 2. the verifier's rewards (batch.rewards) -> 3. group-relative advantages (Eq. 18)
        A = group_advantages(batch.rewards, G).to(args.device)                      # (B,)
        A = torch.where(A < 0, args.neg_weight * A, A)  # learn more from successes than from failures
        # 4. n_t masked copies of each completion, drawn once: the old and new policy see the same masks
        mc = draw_mc_samples(B, L, args.mc_samples, generator).to(args.device)
        old_terms = None                     # on-policy: the update's own terms, detached (log_ratio)
        if off_policy(args):
            with torch.no_grad():
                old_terms = elbo_terms(model, batch.x, batch.y, mc)                 # (B, M)
        # 5. the update: BGPO's bound, backpropagated one MC sample at a time (rl_backward -> bgpo_backward);
        # with --minibatches K, one update per K-th of the prompts (whole groups), the first on-policy (unless
        # its groups all tie and it is skipped)
        warmup = min(1.0, step / args.rl_warmup) if args.rl_warmup else 1.0
        for group in optimizer.param_groups:
            group["lr"] = args.rl_lr * warmup
        minibatch = torch.arange(B, device=A.device) * args.minibatches // B                # (B,) 0..K-1
        losses = []
        with ActivationMemory(model) as memory:
            for _ in range(args.updates_per_batch):
                for k in range(args.minibatches):
                    rows = minibatch == k
                    optimizer.zero_grad(set_to_none=True)
                    if not A[rows].any():  # every group tied: no signal; an Adam step would move the weights
                        continue
                    losses.append(rl_backward(model, batch, mc, old_terms, A, args, rows))
                    if not math.isfinite(losses[-1]):  # the update is skipped; the checkpoint is untouched
                        raise log.diverged(step, losses[-1])
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
        loss = statistics.fmean(losses) if losses else 0.0
        log.step(step, batch, loss, memory.peak, time.time() - t0)  # evaluates and saves when due
    return log.history

class RLLog:
    """An RL run's bookkeeping, shared with the lab's loop: its folder (--out-dir/--run-name), resuming, the
    held-out evaluations (step 0 and every --eval-every), log.jsonl with one record a step, checkpoints."""

    def __init__(self, args, task, model, optimizer, generator):
        self.args, self.task, self.model = args, task, model
        self.optimizer, self.generator = optimizer, generator
        run_dir = os.path.join(args.out_dir, args.run_name)
        self.ckpt_path, self.log_path = os.path.join(run_dir, "ckpt.pt"), os.path.join(run_dir, "log.jsonl")
        self.eval_prompts = held_out(task, args)
        if args.resume:
            state = load_checkpoint(self.ckpt_path, task, model.config)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            generator.set_state(state["rng"])
            self.start, self.history = state["step"] + 1, state["history"]
            lines = open(self.log_path).read().splitlines() if os.path.exists(self.log_path) else []
            print(f"resumed {self.ckpt_path} at step {state['step']}")
        else:
            os.makedirs(run_dir, exist_ok=True)
            self.start, self.history, record = 1, [], {"step": 0}
            show_unmasking(model, task, self.eval_prompts[0], args)
            print(f"step 0 (SFT model): {self.evaluate(record)}\n" + "\n".join(self.history[-1]["examples"]))
            lines = [json.dumps(record)]
        with open(self.log_path, "w") as f:  # the log matches the checkpoint: drop lines written after it
            f.writelines(line + "\n" for line in lines if json.loads(line)["step"] < self.start)
        self.good_step = self.start - 1

    def evaluate(self, record):
        """Greedy answers to the held-out problems: adds accuracy and eval_reward to record; returns text."""
        self.history.append({"step": record["step"], **evaluate(self.model, self.task, self.eval_prompts,
                                                                 self.args)})
        record.update(accuracy=self.history[-1]["accuracy"], eval_reward=self.history[-1]["reward"])
        return f"held-out accuracy {record['accuracy']:.1%} (reward {record['eval_reward']:.3f})"

    def step(self, step, batch, loss, activation_bytes, seconds, fields=None, text=None):
        """Log one step (fields and text: the lab's); evaluate and save when due."""
        args, r, groups = self.args, batch.rewards, reward_groups(batch.rewards, self.args.group_size)
        record = {"step": step, "reward": r.mean().item(), "reward_std": r.std().item(),
                  "mixed_groups": (groups.amax(1) > groups.amin(1)).double().mean().item(),  # A != 0
                  "solved": (r == 1.0).double().mean().item(),
                  "valid": sum(map(self.task.valid, batch.prompts, batch.texts)) / len(r), "loss": loss,
                  "activation_mb": activation_bytes / 2**20, "seconds": seconds, **(fields or {})}
        line = (f"step {step:4d} | reward {record['reward']:.3f} ± {record['reward_std']:.3f} | "
                f"mixed groups {record['mixed_groups']:4.0%} | solved {record['solved']:5.1%} | act "
                f"{record['activation_mb']:.1f} MB | {seconds:.2f} s" + (f" | {text}" if text else ""))
        if step % args.eval_every == 0 or step == args.rl_steps:
            line += f" | {self.evaluate(record)}\n" + "\n".join(self.history[-1]["examples"])
        print(line)
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if step % args.save_every == 0 or step == args.rl_steps:
            save_checkpoint(self.ckpt_path, stage="rl", task=self.task.name, vocab=self.task.tokenizer.itos,
                            config=asdict(self.model.config), step=step, model=self.model.state_dict(),
                            optimizer=self.optimizer.state_dict(), rng=self.generator.get_state(),
                            history=self.history)
            self.good_step = step

    def diverged(self, step, loss):
        kept = f"{self.ckpt_path} (step {self.good_step})" if self.good_step else "none yet"
        return RunError(f"loss is {loss} at RL step {step}; stopped. Last good checkpoint: {kept}")

def show_unmasking(model, task, prompt, args):
    """Print once how the greedy sampler writes one answer: at every step it predicts every masked
    position and commits the most confident ones (low-confidence remasking); '_' is MASK, '$' EOS."""
    x = encode(task, [prompt], device=args.device)
    y, commit_steps = generate(model, x, task.gen_len, steps=args.gen_steps, block_len=args.block_len,
                               return_steps=True)
    states = [task.decode(y[0].masked_fill(commit_steps[0] > s, model.config.mask_id).cpu(), False)
              for s in range(int(commit_steps.max()) + 1)]
    print(f"how the sampler writes {prompt} (greedy, one token per step, the most confident first; "
          f"_ is MASK, $ the end):\n" + textwrap.fill("  ".join(states), 100, initial_indent="    ",
                                                       subsequent_indent="    "))

# -----------------------------------------------------------------------------
# 5. The memory benchmark: naive vs BGPO as n_t grows, on one RL batch of a real task

def bench_batch(task, args):
    """B = G x prompts demonstrations with random rewards that never tie, so that every row is in the
    update (memory and time depend on the shapes, not the values), and a random writing order as
    commit_steps (for the lab's objectives). Returns the batch, its A and the generator."""
    B, generator = args.group_size * args.prompts_per_step, torch.Generator().manual_seed(args.seed)
    prompts, answers = task.sample(B, "train", generator)
    x, y = encode(task, prompts, answers, device=args.device)
    rewards = torch.rand(B, generator=generator).to(torch.get_default_dtype())
    commit = torch.rand(B, task.gen_len, generator=generator).argsort(1).argsort(1).to(args.device)
    A = group_advantages(rewards, args.group_size).to(args.device)
    return Rollouts(prompts, x, y, commit, answers, rewards), A, generator

def measure_update(model, optimizer, backward, args):
    """backward() --bench-repeats times, each between zero_grad and an optimizer step:
    (peak activation MB, median seconds, CUDA allocator's peak MB or nan)."""
    cuda, times = args.device.startswith("cuda"), []
    for _ in range(args.bench_repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with ActivationMemory(model) as memory:
            optimizer.zero_grad(set_to_none=True)
            backward()
            optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    cuda_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else math.nan
    return memory.peak / 2**20, statistics.median(times), cuda_mb

def bench_memory(args, task):
    torch.manual_seed(args.seed)
    model = make_model(task, args).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch, A, generator = bench_batch(task, args)
    cuda = args.device.startswith("cuda")

    def measure(objective, n_t, mc_chunk=1):
        settings = argparse.Namespace(**{**vars(args), "objective": objective, "mc_chunk": mc_chunk,
                                         "updates_per_batch": 1})
        mc = draw_mc_samples(len(A), task.gen_len, n_t, generator).to(args.device)
        backward = lambda: rl_backward(model, batch, mc, None, A, settings)
        return measure_update(model, optimizer, backward, args)

    print(f"model {model.num_params() / 1e6:.2f}M params | task {task.name} | batch B = {args.group_size} x "
          f"{args.prompts_per_step} = {len(A)}, L = {task.gen_len} | device {args.device} | "
          f"median of {args.bench_repeats} update steps")
    cuda_head = f" | {'naive CUDA MB':>13} {'BGPO CUDA MB':>12}" if cuda else ""
    print(f"{'n_t':>4} | {'naive MB':>9} {'BGPO MB':>8} {'naive/BGPO':>10} | {'naive s':>8} {'BGPO s':>7} "
          f"{'BGPO/naive':>10}" + cuda_head)
    rows = []
    for n_t in (1, 2, 4, 8, 16, 32, 64):
        naive, bgpo = measure("naive", n_t), measure("bgpo", n_t)
        rows.append({"n_t": n_t, "naive_mb": naive[0], "bgpo_mb": bgpo[0], "naive_s": naive[1],
                     "bgpo_s": bgpo[1]})
        if cuda:
            rows[-1].update(naive_cuda_mb=naive[2], bgpo_cuda_mb=bgpo[2])
        cuda_cells = f" | {naive[2]:>13.1f} {bgpo[2]:>12.1f}" if cuda else ""
        print(f"{n_t:>4} | {naive[0]:>9.1f} {bgpo[0]:>8.1f} {naive[0] / bgpo[0]:>10.2f} | {naive[1]:>8.3f} "
              f"{bgpo[1]:>7.3f} {bgpo[1] / naive[1]:>10.2f}" + cuda_cells)
    print(f"\nBGPO at n_t = {args.mc_samples}: --mc-chunk trades memory for speed")
    print(f"{'mc_chunk':>8} | {'BGPO MB':>8} | {'BGPO s':>7}" + (f" | {'CUDA MB':>8}" if cuda else ""))
    for chunk in sorted(c for c in {1, 2, 4, 8, args.mc_samples} if c <= args.mc_samples):
        mb, s, cuda_mb = measure("bgpo", args.mc_samples, chunk)
        print(f"{chunk:>8} | {mb:>8.1f} | {s:>7.3f}" + (f" | {cuda_mb:>8.1f}" if cuda else ""))
    return rows

# -----------------------------------------------------------------------------
# 6. The command line

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, without the usage dump
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

def at_least(low, cast=int, what="an integer >= {}"):
    """An argparse type: a finite number of type cast, >= low (and > 0 for floats)."""
    def parse(text):
        try:
            v = cast(text)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or v < low or (cast is float and v <= 0):
            raise argparse.ArgumentTypeError(f"expected {what.format(low)}, got {text!r}")
        return v
    return parse

positive_int = at_least(1, what="a positive integer")
non_negative_int = at_least(0)
positive_float = at_least(0.0, float, "a positive number")

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # adds "(default: ...)" unless the help already says it
        return action.help if "default:" in action.help else super()._get_help_string(action)

def make_parser(prog="bgpo.py", description="SFT, then BGPO RL of a tiny masked diffusion LM."):
    """The tutorial's flags. Adding a flag again replaces it (the lab's --objective does)."""
    p = ArgumentParser(prog=prog, description=description, conflict_handler="resolve",
                       formatter_class=HelpFormatter)
    a = p.add_argument
    # what to run
    a("--stage", choices=["sft", "rl", "all"], default="all", help="sft, rl (from its checkpoint), or both")
    a("--task", default="countdown", help=f"one of {', '.join(TASKS)}")
    a("--seed", type=int, default=0, help="seed for weights, data and sampling")
    a("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    a("--out-dir", default="out", help="where checkpoints and logs go")
    a("--bench-memory", action="store_true", help="print the naive vs BGPO memory and time table, then exit")
    a("--bench-repeats", type=positive_int, default=3, help="update steps timed per row of --bench-memory")
    # model
    a("--n-layer", type=positive_int, default=3, help="transformer blocks")
    a("--n-head", type=positive_int, default=4, help="attention heads")
    a("--n-embd", type=positive_int, default=128, help="embedding width")
    # SFT
    a("--demos", type=non_negative_int, default=None,
      help=f"training problems with answers that SFT learns from; 0: fresh ones each step (default: {DEMOS})")
    a("--sft-steps", type=positive_int, default=2000, help="most SFT steps; the cosine schedule spans them")
    a("--sft-lr", type=positive_float, default=1e-3, help="SFT peak learning rate")
    a("--batch-size", type=positive_int, default=128, help="SFT batch size")
    a("--sft-eval-every", type=positive_int, default=50, help="SFT steps between validation scores")
    a("--sft-patience", type=positive_int, default=4, help="scores without a better one before SFT stops")
    a("--val-size", type=positive_int, default=200, help="validation problems, to choose the SFT model")
    # RL
    a("--objective", choices=["bgpo", "naive"], default="bgpo", help="BGPO's bound or the naive objective")
    a("--mc-samples", type=positive_int, default=8, help="MC samples n_t per completion")
    a("--mc-chunk", type=positive_int, default=1, help="MC samples per backward in BGPO")
    a("--updates-per-batch", type=positive_int, default=1, help="passes over a rollout batch; 1 = on-policy")
    a("--minibatches", type=positive_int, default=1,
      help="updates per pass over a rollout batch, each on an equal share of its prompts (whole groups); "
           "2 = the paper's off-policy scheme")
    a("--clip-eps", type=positive_float, default=0.2, help="PPO clip, used when off-policy")
    a("--rl-steps", type=positive_int, default=200, help="RL steps, one rollout batch each")
    a("--rl-lr", type=positive_float, default=1e-4, help="RL learning rate")
    a("--rl-warmup", type=non_negative_int, default=0, help="RL steps of linear learning-rate warmup")
    a("--neg-weight", type=float, default=0.5, help="weight of negative advantages, in [0, 1]")
    a("--prompts-per-step", type=positive_int, default=16, help="prompts per RL step")
    a("--group-size", type=positive_int, default=8, help="completions per prompt, G")
    a("--temperature", type=float, default=1.3, help="rollout temperature; evaluation is greedy")
    a("--gen-steps", type=positive_int, default=None, help="denoising steps (default: L, one token per step)")
    a("--block-len", type=positive_int, default=None, help="block length (default: L, one block)")
    a("--eval-every", type=positive_int, default=25, help="held-out evaluation every N RL steps")
    a("--eval-size", type=positive_int, default=500, help="held-out problems")
    a("--save-every", type=positive_int, default=25, help="checkpoint every N RL steps")
    a("--run-name", default=None,
      help="RL run folder in --out-dir (default: task_objective_ntM_uU[_kK]_seedS)")
    a("--resume", action="store_true", help="continue the run in --run-name from its last checkpoint")
    return p

def device_available(device):
    if device in ("auto", "cpu"):
        return True
    if device == "mps":
        return torch.backends.mps.is_available()
    if device == "cuda" or device.startswith("cuda:") and device[5:].isdigit():
        index = int(device[5:] or 0)
        return torch.cuda.is_available() and index < torch.cuda.device_count()
    return False

def check_args(p, args):
    """Check the flags against each other (p.error: one line, exit 2) and fill the derived defaults."""
    if args.task not in TASKS:
        p.error(f"unknown task {args.task!r}; choose one of {', '.join(TASKS)}")
    L = get_task(args.task).gen_len
    blocks = math.ceil(L / (args.block_len or L))
    args.demos = DEMOS[args.task] if args.demos is None else args.demos
    if not args.run_name:
        minibatches = f"_k{args.minibatches}" if args.minibatches > 1 else ""
        args.run_name = (f"{args.task}_{args.objective}_nt{args.mc_samples}_u{args.updates_per_batch}"
                         f"{minibatches}_seed{args.seed}")
    run_dir = os.path.join(args.out_dir, args.run_name)
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be divisible by --n-head {args.n_head}")
    if args.group_size < 2:
        p.error(f"--group-size must be at least 2 (advantages compare completions), got {args.group_size}")
    if args.mc_chunk > 1 and args.objective != "bgpo":
        p.error(f"--mc-chunk is an option of --objective bgpo, not {args.objective}")
    if args.mc_chunk > args.mc_samples:
        p.error(f"--mc-chunk {args.mc_chunk} is larger than --mc-samples {args.mc_samples}")
    if args.prompts_per_step % args.minibatches:
        p.error(f"--minibatches {args.minibatches} must divide --prompts-per-step {args.prompts_per_step} "
                f"(a mini-batch is whole groups)")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 <= args.neg_weight <= 1:
        p.error(f"--neg-weight must be in [0, 1], got {args.neg_weight}")
    if (args.block_len or 0) > L or (args.gen_steps or 0) > L:
        p.error(f"--block-len and --gen-steps must be at most the completion length {L} of {args.task}")
    if (args.gen_steps or blocks) < blocks:
        p.error(f"--gen-steps must be at least the number of blocks, {blocks}")
    if args.resume and not os.path.isfile(os.path.join(run_dir, "ckpt.pt")):
        p.error(f"--resume: no run to resume at {os.path.join(run_dir, 'ckpt.pt')}")
    if args.resume and args.stage == "sft":
        p.error("--resume continues an RL run; use it with --stage rl or all")
    if not device_available(args.device):
        p.error(f"--device {args.device} is not available here")
    if args.device == "auto":
        args.device = next(d for d in ("cuda", "mps", "cpu") if device_available(d))
    return args

def parse_args(argv=None):
    p = make_parser()
    return check_args(p, p.parse_args(argv))

def run(args, rl=None):
    """SFT (or a matching SFT checkpoint), then RL (run_rl, or rl: the lab's loop), then a summary."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # every progress line reaches a log file as it is printed
    task, t0 = get_task(args.task), time.time()
    print(f"task {task.name} | device {args.device} | seed {args.seed}")
    model = sft_model(args, task)
    if args.stage == "sft":
        result = evaluate(model, task, held_out(task, args), args)
        print(f"SFT held-out accuracy {result['accuracy']:.1%}, mean reward {result['reward']:.3f}\n"
              + "\n".join(result["examples"]) + f"\ndone in {time.time() - t0:.0f} s")
        return result
    history = (rl or run_rl)(args, task, model)
    summarize(args, history, time.time() - t0)
    return history

def summarize(args, history, seconds):
    print(f"\n{'':>22} {'accuracy':>9} {'reward':>7}")
    for name, h in (("SFT model", history[0]), (f"after {history[-1]['step']} RL steps", history[-1])):
        print(f"{name:>22} {h['accuracy']:>9.1%} {h['reward']:>7.3f}")
    run_dir = os.path.join(args.out_dir, args.run_name)
    print(f"({args.run_name}: {seconds:.0f} s on {args.device})\nfiles: {sft_path(args)}, "
          f"{os.path.join(run_dir, 'ckpt.pt')}, {os.path.join(run_dir, 'log.jsonl')}")

def main(argv=None):
    args = parse_args(argv)
    return bench_memory(args, get_task(args.task)) if args.bench_memory else run(args)

def command_line(main, prog):
    """Run main(); bad input, a bad checkpoint or a diverged run print one line and exit with code 2."""
    try:
        return main()
    except RunError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)

# -----------------------------------------------------------------------------
# 7. Exact likelihoods by enumeration, for the tests and the lab (L <= 10 in seconds on a CPU)

def subset_masks(L, device=None):
    """Every subset of L positions as a (2^L, L) bool row: row S is the subset with bitmask S."""
    bits = torch.arange(2**L, device=device)
    return (bits[:, None] >> torch.arange(L, device=device)) & 1 == 1

def log_probs_under_every_mask(model, prompt, completion, chunk=4096):
    """The table behind every exact quantity, for one prompt (P,) and completion (L,): masks (N, L),
    every non-empty subset S of the positions (row r is bitmask r + 1, N = 2^L - 1), and logp (N, L)
    with logp[S, i] = log p(y^i | y with S masked, x). Differentiable; chunk bounds the rows per forward."""
    L = completion.shape[0]
    masks = subset_masks(L, completion.device)[1:]                                   # (N, L)
    rows = [masked_log_likelihood(model, prompt.expand(len(m), -1), completion.expand(len(m), L), m,
                                  per_token=True)
            for m in masks.split(chunk)]
    return masks, torch.cat(rows)

def exact_elbo(model, prompt, completion):
    """The ELBO by enumerating the 2^L - 1 mask sets:
    ELBO = sum_{k=1..L} (1/k) mean_{|S|=k} sum_{i in S} log p(y^i | y with S masked, x).
    Both MC schemes have this expectation. Differentiable."""
    return elbo_from_table(*log_probs_under_every_mask(model, prompt, completion))

def elbo_from_table(masks, logp):
    """sum_S a(S) / (k C(L, k)), with a(S) the masked log-likelihood of set S and k = |S|."""
    L, k = masks.shape[1], masks.sum(1)
    n_sets = torch.tensor([math.comb(L, int(j)) for j in k], dtype=logp.dtype, device=logp.device)
    return ((logp * masks).sum(1) / (k * n_sets)).sum()

def random_order_log_likelihood(model, prompt, completion):
    """An any-order autoregressive model that reveals y one uniformly random position at a time:
    returns (E_sigma log p_sigma(y), log E_sigma p_sigma(y)). The first equals the ELBO (RADD's
    theorem), the second bounds it from above (Jensen). A dynamic programme over the 2^L sets S of
    still-masked positions gives both without the L! orders: f(empty) = h(empty) = 0,
        f(S) = (1/|S|) sum_{i in S} [log p(y^i | S masked) + f(S - i)]
        h(S) = log (1/|S|) sum_{i in S} exp(log p(y^i | S masked) + h(S - i)).  Differentiable."""
    return random_order_from_table(*log_probs_under_every_mask(model, prompt, completion))

def random_order_from_table(masks, logp):
    L = masks.shape[1]
    size, bit = masks.sum(1), 1 << torch.arange(L, device=masks.device)
    f = h = logp.new_zeros(2**L)                                     # indexed by bitmask; f[0] = 0
    for k in range(1, L + 1):
        rows = (size == k).nonzero()[:, 0]                           # the sets of size k
        S = rows + 1
        child = S[:, None] & ~bit                                    # S - i for each i (S if i not in S)
        inside = masks[rows]
        f = f.index_put((S,), ((logp[rows] + f[child]) * inside).sum(1) / k)
        h_of_S = (logp[rows] + h[child]).masked_fill(~inside, float("-inf")).logsumexp(1) - math.log(k)
        h = h.index_put((S,), h_of_S)
    return f[-1], h[-1]

if __name__ == "__main__":
    command_line(main, "bgpo.py")
