"""The forward waits of ``async_step=True``: each module's forward waits only for the buckets it
reads.

An async step returns at once and steps the offloaded buckets on a worker thread while the next
forward runs. :class:`ForwardWaits` is a subscriber of the runtime's module schedule, built by
the engine in async mode only: before a module's forward, while a step is :meth:`armed <arm>`,
the host waits each bucket the module reads until its step is over and the current stream waits
its copy-back (:meth:`Bucket.wait_stepped <offload_adam.optim.grads.Bucket.wait_stepped>`). A
module reads the buckets of its own parameters, of those its code was seen to read on the first
forward (recorded by the schedule: a parent reading a child's weight), and of its submodules
never called themselves (they have no pre-hook of their own).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import Tensor

from ..runtime.device import Device
from ..runtime.schedule import SCHEDULE, Subscription
from .grads import StreamedGrads


class ForwardWaits:
    """The module schedule's subscriber of one optimizer in async mode (see the module
    documentation); held weakly by the schedule, strongly by the engine."""

    def __init__(self, streamed: StreamedGrads, device: Device) -> None:
        self.streamed = streamed
        self.device = device
        # Modules seen running, parameters each one reads.
        self._called: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._reads: weakref.WeakKeyDictionary[torch.nn.Module, set[int]] = weakref.WeakKeyDictionary()
        self._recorded = False
        self._wait_cache: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[int]]] = weakref.WeakKeyDictionary()
        self._stats: dict[str, float] | None = None  # a step in flight: its stats (None: nothing to wait for)
        self._schedule: Subscription | None = SCHEDULE.subscribe(self)
        self._schedule.record_next()  # the reads of the first forward

    def arm(self, stats: dict[str, float]) -> None:
        """A step runs on the worker: forwards wait for it (their waits counted in ``stats``)
        until :meth:`disarm`."""
        self._stats = stats

    def disarm(self) -> None:
        """The step is over and the current stream waits its copies: nothing to wait for."""
        self._stats = None

    def close(self) -> None:
        if self._schedule is not None:
            self._schedule.cancel()
            self._schedule = None

    # The schedule's subscriber interface (runtime/schedule.py).

    def post_forward(self, module: torch.nn.Module) -> None:
        pass

    def read_key(self, t: Tensor) -> int | None:
        r = self.streamed.by_param.get(id(t))
        return None if r is None else r.bucket

    def on_read(self, module: torch.nn.Module, key: Any) -> None:
        self._reads.setdefault(module, set()).add(key)

    def pass_ended(self, recorded: bool) -> None:
        if recorded:
            self._recorded = True
            self._wait_cache = weakref.WeakKeyDictionary()

    def _wait_buckets(self, module: torch.nn.Module) -> list[int]:
        """Buckets a module's forward reads: its own parameters', those its code was seen to
        read (a child's weight read without calling the child, or before calling it), and those
        of submodules never called themselves, which have no pre-hook of their own. Before a
        first forward was recorded: every bucket under the module."""
        hit = self._wait_cache.get(module)
        if hit is not None and hit[0] == len(self._called):
            return hit[1]
        st = self.streamed
        params = [p for p in module._parameters.values() if p is not None]
        stack = [c for c in module._modules.values() if c is not None]
        while stack:
            c = stack.pop()
            if c in self._called and self._recorded:
                continue
            params += [p for p in c._parameters.values() if p is not None]
            stack += [m for m in c._modules.values() if m is not None]
        buckets = {st.by_param[id(p)].bucket for p in params if id(p) in st.by_param}
        buckets |= self._reads.get(module, set())
        out = sorted(buckets)
        self._wait_cache[module] = (len(self._called), out)
        return out

    def pre_forward(self, module: torch.nn.Module) -> None:
        """Before a module's forward: waits for the buckets it reads."""
        if module not in self._called:
            self._called.add(module)
        stats = self._stats
        if stats is None:
            return
        t0 = time.perf_counter()
        waited = False
        for k in self._wait_buckets(module):
            waited |= self.streamed.buckets[k].wait_stepped(self.device)
        if waited:
            stats["forward_wait_s"] = stats.get("forward_wait_s", 0.0) + time.perf_counter() - t0
