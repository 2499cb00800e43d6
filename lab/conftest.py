"""The lab's tests run in float64, as the tutorial's do (the same autouse fixture, copied)."""
import pytest
import torch

@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
