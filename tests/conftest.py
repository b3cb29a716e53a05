from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offload_adam.testing import simbackend

# The simulated device's type, registered before any backward runs: autograd sizes its per-device
# queues once, at the process's first backward, from the device counts then (a process without
# CUDA that registers it later cannot run a backward on it; simulated_device() registers it too,
# for scripts). Not where CUDA is: a registered PrivateUse1 becomes torch's accelerator, and
# autograd then keeps no stream of a CUDA node (Node::stream asks the accelerator's type), so the
# CUDA tests (the GPU check runs only those) would not run as a user's code does; there the
# queues exist for device 0 already, and a simulated_device() registers it when first entered.
if not torch.cuda.is_available():
    try:
        simbackend.register()
    except Exception as e:  # a torch without Python-registered PrivateUse1 backends
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


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the test (set back after): for tests of whole models whose operations
    are tiny. On two threads of a loaded 2-core machine they spin-wait each other: a 3-row
    ``index_add_`` took 16 ms instead of 5 us, a 12-step LoRA training of test_moe_training 11 s
    instead of 0.7 s. The references of these tests are computed under it too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
