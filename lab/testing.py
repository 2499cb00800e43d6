"""The lab tests' tiny models, batches and helpers (copied from the tutorial's test_bgpo.py)."""
import os

import pytest
import torch

from bgpo import draw_mc_samples, elbo_terms
from lab.figures import read_log   # noqa: F401 (the lab tests read logs through this module)
from tiny_dllm import ModelConfig, TinyDLLM

# a test that needs a real CUDA runtime, which python -m lab.simulated_cuda's faked cards are not
needs_real_cuda = pytest.mark.skipif("SIMULATED_CUDA" in os.environ, reason="a faked card computes nothing")

def tiny_model(seed=0, vocab_size=10, max_len=12, scale=0.5):
    """A random model whose conditionals differ clearly from position to position."""
    torch.manual_seed(seed)
    model = TinyDLLM(ModelConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=16, max_len=max_len,
                                 mask_id=1))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=scale)
    return model

def random_batch(B=6, P=3, L=5, vocab_size=10, seed=0):
    """Prompts and completions of ordinary tokens (ids 2.., never MASK=1)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab_size, (B, P), generator=generator)
    completions = torch.randint(2, vocab_size, (B, L), generator=generator)
    return prompts, completions

def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])

def report(a, b):
    diff = (a - b).abs()
    return f"max |diff| {diff.max().item():.3g}, mean |diff| {diff.mean().item():.3g}"

def on_policy_setup(M=6, seed=0):
    model = tiny_model(seed)
    x, y = random_batch(B=6)
    mc = draw_mc_samples(6, 5, M, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        old_terms = elbo_terms(model, x, y, mc)
    A = torch.tensor([1.5, -0.5, 0.0, -1.2, 0.7, 0.0])                   # positive, negative and zero
    return model, x, y, mc, old_terms, A

def tiny_argv(tmp_path, *extra):
    """Command-line flags (bgpo.py's, so that bgpo.main and every lab command take them) for a model and run
    small enough to train in seconds."""
    return ["--task", "arithmetic", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
            "--sft-steps", "100", "--prompts-per-step", "2", "--group-size", "4", "--mc-samples", "4",
            "--rl-steps", "2", "--eval-size", "8", "--eval-every", "1", "--val-size", "16",
            "--sft-eval-every", "50", "--out-dir", str(tmp_path), "--device", "cpu", *extra]
