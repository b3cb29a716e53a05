"""Runs a function on 2 processes over gloo (CPU), each with a timeout, and gathers results.
With ``env={SIMULATE: "1"}`` the function runs inside the simulated device (``simgpu``), over
gloo for its tensors (``offload_adam.testing.simdist``): it moves its model and batches there as
to "cuda" (``helpers.to_device``); what it returns comes back on the host.

Used by the distributed tests; the workers live in this module so that spawned processes can
import them. Two ranks over gloo (the common case) run in a pool of 2 processes kept for the
whole session: starting a process that imports torch costs seconds, and a session has dozens of
these calls. Each call gets its own process group (a fresh rendezvous), its environment
variables for its duration only, and the pool is replaced after any failure or hang (the other
rank may be stuck in a collective)."""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT_S = 120.0
# In `env`: the worker runs inside a simulated device (no delays, immediate waits), its process
# group over gloo for the device's tensors too.
SIMULATE = "OFFLOAD_ADAM_TEST_SIMULATE"


def _simulated() -> Any:
    from offload_adam import testing

    return testing.simulated_device(max_delay_s=0.0, lazy=False)


def _prepare() -> None:
    """A worker process: the simulated device's type and its collectives registered before any
    backward runs (autograd sizes its per-device queues at a process's first backward); not
    where CUDA is (as in conftest.py: NCCL runs keep CUDA as torch's accelerator), where a
    simulated call registers them itself."""
    if not torch.cuda.is_available():
        from offload_adam.testing import simdist

        simdist.register()


def _run(
    fn: Callable[..., Any], rank: int, world: int, init: str, q: Any, args: tuple[Any, ...], env: dict[str, str], backend: str
) -> None:
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        sim = bool(env.get(SIMULATE))
        if sim:
            from offload_adam.testing import simdist

            simdist.register()
            backend = simdist.NAME
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        try:
            with _simulated() if sim else contextlib.nullcontext():
                out = fn(rank, world, *args)
                out = torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)  # to the host
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes: tensors through a queue would need the sender alive
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _entry(
    fn: Callable[..., Any], rank: int, world: int, init: str, q: Any, args: tuple[Any, ...], env: dict[str, str], backend: str
) -> None:
    torch.set_num_threads(1)
    _prepare()
    _run(fn, rank, world, init, q, args, env, backend)


def _serve(rank: int, inbox: Any, q: Any) -> None:
    """A pooled rank: runs the calls it is sent until it gets None."""
    torch.set_num_threads(1)
    _prepare()
    while True:
        msg = inbox.get()
        if msg is None:
            return
        fn, world, init, args, env = msg
        _run(fn, rank, world, init, q, args, env, "gloo")


def _collect(q: Any, world: int, timeout: float) -> tuple[dict[int, Any], list[str]]:
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, out = q.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{out}")
                break
    except queue.Empty as e:  # a hang
        errors.append(f"timed out after {timeout} s: {e!r}")
    return results, errors


class _Pool:
    WORLD = 2

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.WORLD)]
        self.procs = [ctx.Process(target=_serve, args=(r, self.inboxes[r], self.q), daemon=True) for r in range(self.WORLD)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str], timeout: float) -> tuple[dict[int, Any], list[str]]:
        with tempfile.TemporaryDirectory() as d:
            init = "file://" + os.path.join(d, "rendezvous")
            for box in self.inboxes:
                box.put((fn, self.WORLD, init, args, env))
            return _collect(self.q, self.WORLD, timeout)

    def close(self, kill: bool) -> None:
        for box, p in zip(self.inboxes, self.procs):
            if not kill:
                box.put(None)
            p.join(timeout=0.5 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()


_pool: _Pool | None = None


@atexit.register
def _close_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close(kill=False)
        _pool = None


def spawn(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes (``backend`` gloo on the CPU, or nccl
    with one GPU per rank); returns the results by rank. A worker that raises or hangs fails
    the caller (hung processes are killed)."""
    global _pool
    results: dict[int, Any] = {}
    errors: list[str] = ["interrupted"]
    if world == _Pool.WORLD and backend == "gloo":
        if _pool is None:
            _pool = _Pool()
        try:
            results, errors = _pool.run(fn, args, env or {}, timeout)
        except BaseException:
            _pool.close(kill=True)
            _pool = None
            raise
        if errors:
            _pool.close(kill=True)
            _pool = None
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            init = "file://" + os.path.join(d, "rendezvous")
            procs = [
                ctx.Process(target=_entry, args=(fn, r, world, init, q, args, env or {}, backend), daemon=True)
                for r in range(world)
            ]
            for p in procs:
                p.start()
            try:
                results, errors = _collect(q, world, timeout)
            finally:
                for p in procs:
                    p.join(timeout=5 if not errors else 0.5)
                    if p.is_alive():
                        p.kill()
                        p.join()
    if errors:
        raise AssertionError("distributed worker failed: " + "\n".join(errors))
    return [results[r] for r in range(world)]
