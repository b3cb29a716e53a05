"""Weights offloaded: a model's parameters kept in pinned host memory or on NVMe and streamed to
the device block by block, ahead of need, in three stages (ARCHITECTURE.md, "weights/"):

- plan: ``blocks.py`` (what a block is), ``plan.py`` (where each block lives and runs, the rings:
  a ``WeightPlan``, pure);
- build: ``offload.py`` (the entry points and the handle), ``storage.py`` (where the bytes live:
  the sources), ``checkpoint.py`` (loading from safetensors), ``quantize.py``, ``undo.py``;
- run: ``streamer.py`` (the schedule's subscriber) over ``ring.py`` (the device slots and what
  they hold), ``cycle.py`` (the recorded order and its prefetch cursor), ``loader.py`` (one
  block's copy) and ``saved.py`` (what a training forward saves); ``placement.py`` with
  ``costs.py`` (where each call runs) and ``hostmatmul.py``/``frozen.py`` (the CPU's and a
  frozen quantized linear's calls); ``experts.py`` over ``expertstore.py`` (a mixture of
  experts' routed experts, stored per expert, run through transformers' experts interface)."""

from .offload import WeightOffload, offload_weights, plan_weights
from .plan import BlockPlan, WeightPlan

__all__ = ["BlockPlan", "WeightOffload", "WeightPlan", "offload_weights", "plan_weights"]
