"""The lab's tests run in float64, as the tutorial's do (the same autouse fixture, copied), and their tiny
models' SFT draws batches of 32 demonstrations instead of bgpo.SFT_BATCH's 128: as much as they learn from,
in a quarter of the time (the SFT checkpoint's name records the batch, so no test reuses another's)."""
import pytest
import torch

import bgpo

@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)

@pytest.fixture(autouse=True)
def small_sft_batches(monkeypatch):
    monkeypatch.setattr(bgpo, "SFT_BATCH", 32)
