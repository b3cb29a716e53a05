"""Testing aids, passed in by tests; the product never imports this package.

* :func:`simulated_device`: what is built inside (optimizers, weight offloads) streams its CPU
  tensors through a :class:`~offload_adam.testing.simdevice.SimulatedDevice` (CUDA stream
  semantics on the CPU: late copies, events, lazy waits of the current stream, poisoned freed
  memory, the happens-before check of copies against compute, the caching allocator's reuse,
  pinned against pageable host memory, the current device), installed with the runtime's
  :func:`~offload_adam.runtime.device.use_device`.
* :func:`engine_hooks`: optimizers built inside call these hooks of the step engine: before
  each bucket of a step, and to start the step's worker thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from ..optim.engine import HOOKS, EngineHooks
from ..runtime.device import use_device
from .simdevice import SimulatedDevice


__all__ = ["EngineHooks", "SimulatedDevice", "active_device", "engine_hooks", "simulated_device"]

_DEVICE: ContextVar[SimulatedDevice | None] = ContextVar("offload_adam_sim_device", default=None)


def active_device() -> SimulatedDevice | None:
    """The simulated device of the innermost :func:`simulated_device`, if any."""
    return _DEVICE.get()


@contextlib.contextmanager
def simulated_device(
    seed: int = 0,
    max_delay_s: float = 0.002,
    lazy: bool = True,
    copies_on_demand: bool = False,
    keep_open: bool = False,
    *,
    check_ordering: bool | None = None,
    strict: bool | None = None,
    index: int = 0,
) -> Iterator[SimulatedDevice]:
    """What is built inside streams its CPU tensors through a simulated device; with ``lazy``,
    waits of the current stream are honoured at this thread's next device operation; with
    ``copies_on_demand`` (benchmarks), copies run only when waited for. On exit the device is
    closed (its later work runs inline), unless ``keep_open`` (what was built is used after).

    ``check_ordering`` (default: ``lazy``, as tests run): every copy is checked against the
    compute it must follow (happens-before, with a dispatch mode recording the compute's reads
    and writes). ``strict`` (default: ``lazy``): an asynchronous copy from or to pageable host
    memory is a violation. ``index``: the device's number (a model on ``cuda:index``; its work
    must not touch device 0).

    The device's tensors are on a device of their own, ``simgpu:index`` (``dev.torch_device``):
    a test moves its inputs there as a user moves them to ``"cuda"``, and an operation that mixes
    them with CPU tensors raises."""
    dev = SimulatedDevice(
        seed=seed, max_delay_s=max_delay_s, copies_on_demand=copies_on_demand,
        check_ordering=lazy if check_ordering is None else check_ordering, strict=lazy if strict is None else strict, index=index,
    )  # fmt: skip
    token = _DEVICE.set(dev)
    try:
        with use_device(dev), dev.lazy() if lazy else contextlib.nullcontext():
            yield dev
    finally:
        _DEVICE.reset(token)
        if not keep_open:
            dev.close()


@contextlib.contextmanager
def engine_hooks(**hooks: Any) -> Iterator[EngineHooks]:
    """Optimizers built inside use these :class:`~offload_adam.optim.engine.EngineHooks`."""
    h = EngineHooks(**hooks)
    token = HOOKS.set(h)
    try:
        yield h
    finally:
        HOOKS.reset(token)
