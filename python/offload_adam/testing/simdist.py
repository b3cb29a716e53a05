"""Collectives for the simulated device: a process group whose collectives on ``simgpu`` tensors
run gloo on host copies, as gloo runs a CUDA tensor's (copied to the host, reduced there, copied
back), and whose CPU tensors go to gloo as they are.

torch.distributed has no backend for a device type registered from Python, and gloo takes CPU
and CUDA tensors only (it reads their memory itself; a ``SimTensor`` has no storage of its own).
So :func:`register` adds a backend, ``simgloo``, whose creator returns :class:`SimGloo`, a Python
``ProcessGroup`` (torch's trampoline routes every collective a C++ caller makes, DDP's reducer
and ``_broadcast_coalesced`` among them, to its Python methods): each collective copies its
``simgpu`` arguments to the host (a synchronous copy: the host waits for the device's stream), runs
gloo's own collective on the copies and waits for it, then copies the tensors the collective
writes back to the device (a write of the current stream). The work handed back is complete.

    simdist.register()
    dist.init_process_group(simdist.NAME, ...)   # then inside testing.simulated_device()
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from . import simbackend

NAME = "simgloo"

# Each collective the trampoline routes to Python, and the positions of the arguments it writes.
_WRITES: dict[str, tuple[int, ...]] = {
    "allreduce": (0,), "allreduce_coalesced": (0,), "reduce": (0,), "broadcast": (0,),
    "allgather": (0,), "all_gather_single": (0,), "all_gather_single_coalesced": (0,),
    "reduce_scatter": (0,), "reduce_scatter_single": (0,), "reduce_scatter_single_coalesced": (0,),
    "alltoall": (0,), "all_to_all_single": (0,), "gather": (0,), "scatter": (0,),
    "send": (), "recv": (0,), "barrier": (),
}  # fmt: skip


def _done(result: Any) -> Any:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _host(x: Any) -> Any:
    return x.cpu() if isinstance(x, simbackend.SimTensor) else x


class SimGloo(dist.ProcessGroup):  # type: ignore[misc]
    """gloo for ``simgpu`` tensors through host copies, and for CPU tensors as it is (see the
    module documentation)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._name = ""
        self._desc = ""

    def getBackendName(self) -> str:  # noqa: N802 (torch's names, here and below)
        return NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _run(self, name: str, *args: Any) -> Any:
        host = tree_map(_host, args)
        getattr(self._gloo, name)(*host).wait()
        written = []
        with torch.no_grad():
            for i in _WRITES[name]:
                if name == "broadcast" and args[-1].rootRank == self.rank():
                    continue  # the root's tensors are the source
                for dst, src in zip(tree_flatten(args[i])[0], tree_flatten(host[i])[0]):
                    if isinstance(dst, simbackend.SimTensor):
                        dst.copy_(src)
                written.append(args[i])
        return _done(written[0] if len(written) == 1 else written)


def _collective(name: str) -> Callable[..., Any]:
    def run(self: SimGloo, *args: Any) -> Any:
        return self._run(name, *args)

    run.__name__ = name
    return run


for _name in _WRITES:
    setattr(SimGloo, _name, _collective(_name))


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SimGloo:
    return SimGloo(store, rank, size, timeout)


def register() -> None:
    """Adds the backend ``simgloo`` (for CPU and ``simgpu`` tensors) to torch.distributed, once,
    with the simulated device's type."""
    simbackend.register()
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", simbackend.NAME])
