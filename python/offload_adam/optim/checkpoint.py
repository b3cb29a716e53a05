"""The optimizer's streaming checkpoints (``save_state``/``load_state``): one safetensors file.

``optimizer.save_state(dir)`` writes ``dir/optimizer.safetensors`` bucket by bucket, each
bucket's state made resident, written and released in turn, so the RAM it needs is the tier's
window (with ``storage="nvme"``) however large the state is. The file is written under a
temporary name and renamed when complete: a checkpoint killed mid-write leaves the previous one
intact. ``optimizer.load_state(dir)`` reads it back the same way, into any tier.

The file is plain safetensors (any safetensors reader opens it): tensors
``state.<id>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``master_param``, and
``step`` as a float32 scalar), ``<id>`` being the parameter's id in ``state_dict()``; the param
groups (as in ``state_dict()``, JSON) are in the metadata under ``param_groups``. Complex
parameters' state is stored as its real view (a trailing dimension of 2), noted under
``complex``. Written and read by ``runtime/safetensors.py``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..runtime.safetensors import Entry, Reader, Writer

__all__ = ["FILE", "FORMAT", "Entry", "Reader", "Writer", "jsonable"]

FILE = "optimizer.safetensors"
FORMAT = "offload_adam.optimizer_state/1"


def jsonable(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, list):
        return [jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    raise TypeError(f"param group value {x!r} cannot be stored in a checkpoint")
