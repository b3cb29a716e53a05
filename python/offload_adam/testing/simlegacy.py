"""The simulated device's former mode, ``simulated_device(host_memory=True)``: device memory that
is the CPU's (a tensor "on the device" is a CPU tensor the simulator has seen used as device
memory). It cannot see a tensor on the wrong side; the tests of the training paths still run on
it until the simulated device has autocast and collectives of its own (issue 32). What the device
backend (:mod:`~offload_adam.testing.simbackend`) does for ``simgpu`` tensors, two modes do
here: a torch-function mode honours the thread's pending waits before each operation on device
memory, and a dispatch mode records what each operation reads and writes.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .hb import _leaves, bump_version
from .simstreams import _local

# Calls that read no tensor data (metadata, views): no device work, so no wait.
_NO_DEVICE_WORK = frozenset(
    "__get__ __set__ __delete__ __hash__ __len__ data_ptr detach dim element_size is_complex is_contiguous "
    "is_floating_point is_pinned ndimension nelement numel size storage_offset stride "
    "untyped_storage as_strided view view_as view_as_complex view_as_real".split()
)


class DeviceMemory:
    """The CPU storages queued copies or ``empty`` have used as device memory."""

    def __init__(self) -> None:
        self._mem: dict[int, Any] = {}

    def note(self, t: Tensor) -> None:
        st = t.untyped_storage()
        self._mem[st.data_ptr()] = weakref.ref(st)

    def touched(self, tree: Any) -> bool:
        for t in (leaf for x in tree_flatten(tree)[0] if isinstance(x, Tensor) for leaf in _leaves(x)):
            try:
                st = t.untyped_storage()
            except Exception:
                continue
            ref = self._mem.get(st.data_ptr())
            if ref is not None and ref() is st:
                return True
        return False


class HonourWaits(TorchFunctionMode):
    """Honours the current stream's pending waits before each device operation of this thread.

    A torch-function mode (not a dispatch mode, which changes how some in-place foreach ops
    count tensor versions): it sees every torch call of the thread's Python code."""

    def __init__(self, dev: Any) -> None:
        super().__init__()
        self.dev = dev

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            _local.pending
            and not _local.host_section
            and getattr(func, "__name__", "") not in _NO_DEVICE_WORK
            and self.dev.device_memory.touched((args, kwargs))
        ):
            self.dev._honour()
        return func(*args, **kwargs)


class Stamp(TorchDispatchMode):
    """Records what each compute operation of this thread reads and writes (forward and
    backward), with the current stream's epoch: the happens-before check of the copies."""

    def __init__(self, dev: Any) -> None:
        super().__init__()
        self.dev = dev

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _local.host_section:
            return func(*args, **kwargs)
        lane = self.dev._lane()
        written = self.dev.order.stamp(lane, func, args, kwargs)
        versions = [t._version for t in written] if func.name().startswith("aten::_foreach_") else None
        out = func(*args, **kwargs)
        if versions is not None:
            # A foreach op under a dispatch mode does not bump its outputs' version counters.
            for t, v in zip(written, versions):
                if t._version == v:
                    bump_version(t)
        self.dev.order.stamp_fresh(lane, func, out)
        return out
