"""Runs a function on 2 processes over gloo (CPU), each with a timeout, and gathers results.

Used by the distributed tests; the workers live in this module so that spawned processes can
import them."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT_S = 120.0
# In `env`: the worker's optimizers stream their CPU parameters through a simulated device
# (no delays, immediate waits), as offloaded CUDA parameters would.
SIMULATE = "OFFLOAD_ADAM_TEST_SIMULATE"


def _simulated() -> Any:
    from offload_adam import testing

    return testing.simulated_device(max_delay_s=0.0, lazy=False)


def _entry(
    fn: Callable[..., Any], rank: int, world: int, init: str, q: Any, args: tuple[Any, ...], env: dict[str, str], backend: str
) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        try:
            with _simulated() if env.get(SIMULATE) else contextlib.nullcontext():
                out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes: tensors through a queue would need the sender alive
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


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
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, init, q, args, env or {}, backend), daemon=True) for r in range(world)
        ]
        for p in procs:
            p.start()
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
        except Exception as e:  # queue.Empty: a hang
            errors.append(f"timed out after {timeout} s: {e!r}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("distributed worker failed: " + "\n".join(errors))
    return [results[r] for r in range(world)]
