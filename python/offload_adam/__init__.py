"""offload_adam: train and run PyTorch models larger than the GPU by offloading three things.

* The optimizer state: :class:`AdamW` (and :class:`Adam`) replace ``torch.optim.AdamW``/``Adam``
  with one import; the step runs on the CPU in a fused SIMD multithreaded Rust kernel, with the
  state in host RAM (``storage="cpu"``) or on an SSD (``storage="nvme"``).
* The weights: :func:`offload_weights` keeps a model's weights in pinned RAM or on an SSD and
  streams them to the GPU block by block, for inference and for training; :func:`plan_weights`
  says first where each block would live and run (a ``WeightPlan`` to print, edit and build).
* The activations: :func:`offload_activations` moves what a forward saves for backward to pinned
  RAM or an SSD and brings it back ahead of the backward.

``python -m offload_adam --help`` lists the commands (``plan`` sizes a machine, ``env`` reports
this one); the documentation is in ``docs/`` (``make docs`` builds it).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import _native
from .activations import ActivationOffload, offload_activations
from .optim.ddp import register_ddp_hook
from .runtime.pages import remove_stale_runs, stale_runs
from .weights import WeightOffload, WeightPlan, offload_weights, plan_weights
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


__all__ = ["ActivationOffload", "Adam", "AdamW", "WeightOffload", "WeightPlan", "dequantized", "offload_activations", "offload_weights", "plan_weights", "register_ddp_hook", "remove_stale_runs", "simd_path", "simd_paths", "stale_runs", "__version__"]
