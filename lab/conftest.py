"""The lab's tests run in float64, as the tutorial's do (the same autouse fixture)."""
from test_bgpo import float64  # noqa: F401 (pytest finds the fixture by its name here)
