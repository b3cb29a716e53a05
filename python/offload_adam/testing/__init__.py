"""Testing aids, passed in by tests through context managers (production classes carry none).

* :func:`simulated_device`: optimizers built inside offload their CPU parameters through the
  streaming path with a :class:`~offload_adam.simdevice.SimulatedDevice` (CUDA stream semantics
  on the CPU: late copies, events, lazy waits of the current stream, poisoned freed memory).
* :func:`engine_hooks`: optimizers built inside call these hooks: before each bucket of a step,
  when the step's worker thread starts, and to make the tier that holds their state.

``OFFLOAD_ADAM_FORCE_STREAMING=1`` streams CPU parameters through a shared simulated device
without delays (the demo and the benchmark use it outside tests).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .simdevice import SimulatedDevice

FORCE_ENV = "OFFLOAD_ADAM_FORCE_STREAMING"


@dataclass(frozen=True)
class EngineHooks:
    """Seams of the engine for tests."""

    before_bucket: Callable[[int], None] | None = None  # called with the bucket's index in the step
    start_worker: Callable[[threading.Thread], None] | None = None  # starts the worker thread
    tier: Callable[[], Any] | None = None  # makes the tier that holds the state


_DEVICE: ContextVar[SimulatedDevice | None] = ContextVar("offload_adam_sim_device", default=None)
_HOOKS: ContextVar[EngineHooks] = ContextVar("offload_adam_engine_hooks", default=EngineHooks())


def force_streaming() -> bool:
    """Whether CPU parameters are streamed: inside :func:`simulated_device`, or with
    ``OFFLOAD_ADAM_FORCE_STREAMING=1``."""
    return _DEVICE.get() is not None or os.environ.get(FORCE_ENV, "").strip() not in ("", "0")


def active_device() -> SimulatedDevice | None:
    return _DEVICE.get()


def active_hooks() -> EngineHooks:
    return _HOOKS.get()


@contextlib.contextmanager
def simulated_device(
    seed: int = 0,
    max_delay_s: float = 0.002,
    lazy: bool = True,
    copies_on_demand: bool = False,
    keep_open: bool = False,
) -> Iterator[SimulatedDevice]:
    """Optimizers built inside stream their CPU parameters through a simulated device; with
    ``lazy``, waits of the current stream are honoured at this thread's next device operation;
    with ``copies_on_demand`` (benchmarks), copies run only when waited for. On exit the device
    is closed (its later work runs inline), unless ``keep_open`` (optimizers used afterwards)."""
    dev = SimulatedDevice(seed=seed, max_delay_s=max_delay_s, copies_on_demand=copies_on_demand)
    token = _DEVICE.set(dev)
    try:
        with dev.lazy() if lazy else contextlib.nullcontext():
            yield dev
    finally:
        _DEVICE.reset(token)
        if not keep_open:
            dev.close()


@contextlib.contextmanager
def engine_hooks(**hooks: Any) -> Iterator[EngineHooks]:
    """Optimizers built inside use these :class:`EngineHooks`."""
    h = EngineHooks(**hooks)
    token = _HOOKS.set(h)
    try:
        yield h
    finally:
        _HOOKS.reset(token)
