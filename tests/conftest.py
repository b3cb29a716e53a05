from __future__ import annotations

import pytest
import torch


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
