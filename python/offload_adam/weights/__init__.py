"""Weights offloaded: a model's parameters kept in pinned host memory or on NVMe and streamed to
the device block by block, ahead of need (``offload.py``: the entry point and its handle;
``blocks.py``: what a block is; ``storage.py``: where the bytes live; ``streamer.py``: the ring
and its schedule; ``checkpoint.py``: loading from safetensors)."""

from .offload import WeightOffload, offload_weights

__all__ = ["WeightOffload", "offload_weights"]
