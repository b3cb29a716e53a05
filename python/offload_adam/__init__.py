"""offload_adam: Adam/AdamW on the CPU for PyTorch, with a fused SIMD multithreaded Rust kernel.

``from offload_adam import AdamW`` replaces ``torch.optim.AdamW``; see the README.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import _native
from .activations import ActivationOffload, offload_activations
from .optim.ddp import register_ddp_hook
from .runtime.pager import remove_stale_runs, stale_runs
from .weights import WeightOffload, offload_weights
from .optim.optimizer import Adam, AdamW
from .optim.schema import dequantized

try:
    __version__ = version("offload-adam")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"


def simd_path() -> str:
    """The kernel's SIMD path in this process (``OFFLOAD_ADAM_SIMD``, else the best available)."""
    return _native.simd_path()


def simd_paths() -> list[str]:
    """Every SIMD path this CPU can run, best last."""
    return _native.simd_paths()


__all__ = ["ActivationOffload", "Adam", "AdamW", "WeightOffload", "dequantized", "offload_activations", "offload_weights", "register_ddp_hook", "remove_stale_runs", "simd_path", "simd_paths", "stale_runs", "__version__"]
