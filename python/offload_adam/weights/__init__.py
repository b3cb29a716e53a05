"""Weights offloaded: a model's parameters kept in pinned host memory or on NVMe and streamed to
the device block by block, ahead of need (``offload.py``: the entry point and its handle;
``blocks.py``: what a block is; ``storage.py``: where the bytes live; ``streamer.py``: the
schedule's subscriber, over ``ring.py`` (the device slots), ``cycle.py`` (the recorded order) and
``loader.py`` (one block's copy); ``checkpoint.py``: loading from safetensors)."""

from .offload import WeightOffload, offload_weights

__all__ = ["WeightOffload", "offload_weights"]
