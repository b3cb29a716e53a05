from __future__ import annotations

import pytest
import torch

from offload_adam.testing import simbackend

# The simulated device's type, registered before any backward runs: autograd sizes its per-device
# queues once, at the process's first backward (a process that registers it later cannot run a
# backward on it; simulated_device() registers it too, for scripts).
try:
    simbackend.register()
except Exception as e:  # a torch without Python-registered PrivateUse1 backends: the CUDA tests still run
    import warnings

    warnings.warn(f"the simulated device's type could not be registered ({e!r}): its tests will fail", stacklevel=1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (fuzzing, minutes each)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip without a CUDA device; tests marked ``slow`` skip unless
    ``--run-slow`` is given (``make test-slow``): CI's default run has none of them."""
    skips = []
    if not torch.cuda.is_available():
        skips.append(("cuda", pytest.mark.skip(reason="needs a CUDA device")))
    if not config.getoption("--run-slow"):
        skips.append(("slow", pytest.mark.skip(reason="slow: run with --run-slow (make test-slow)")))
    for item in items:
        for keyword, skip in skips:
            if keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
