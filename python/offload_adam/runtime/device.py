"""Devices: what the offload needs of an accelerator, in one small interface, and one instance
of it per torch device in the process.

Everything that streams (the optimizer's gradients and copy-backs, the weights) goes through a
:class:`Device`, never through CUDA directly, and gets it from :func:`device_for`: one
:class:`CudaDevice` per CUDA device, shared by every client in the process, so that all their
copies to a GPU keep one host-to-device order on one side stream. A CPU tensor has no device
unless one is installed with :func:`use_device`: then CPU tensors are treated as that device's
memory (the test suite installs its simulated device so; this module does not know it).

Semantics every backend keeps (those of CUDA streams):

* ``copy`` queues copies on a side stream; a copy reads its source when it runs, not when it is
  queued. The caller must keep the source unchanged (and, for device tensors it frees, call
  ``keep_until_done``) until an event recorded after the copy has completed.
* ``record(stream)`` returns an event that completes when the stream reaches it;
  ``record_current()`` one on the calling thread's current stream.
* ``stream_waits(stream, e)``: work queued on ``stream`` afterwards waits for ``e``.
* ``current_waits(e)``: device work the calling thread queues afterwards waits for ``e``. It is
  not a host wait: the host goes on at once.
* ``host_wait(e)``: the host blocks until ``e`` has completed.

Every CUDA call is made under the device it is for (:func:`on_device`, :func:`on_stream`): a
thread's current device is 0 until it chooses one, and leaving ``torch.cuda.stream(s)`` sets
the device that was current when it was entered, which creates a context (hundreds of MiB) on
GPU 0 for a model on ``cuda:N``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch import Tensor

log = logging.getLogger("offload_adam")

class Device(Protocol):
    """An accelerator, as the clients of the runtime see it. A device whose tensors are a Python
    subclass (the test suite's simulated GPU) names their class as ``tensor_type``: the runtime
    takes them for plain tensors, not for wrapped (quantized) ones."""

    torch_device: torch.device
    d2h: Any  # side stream of copies to the host
    h2d: Any  # side stream of copies to the device (copy-backs, prefetches)
    h2d_now: Any  # side stream of copies to the device needed now (demand loads), never behind a prefetch's wait

    def host_buffer(self, n: int, dtype: torch.dtype) -> Tensor:
        """A zeroed host buffer of exactly ``n`` elements that copies to and from the device can
        use asynchronously (pinned). It stays valid until its storage is garbage (views of it
        keep it), and is released only after every copy queued so far has completed. Clients
        allocate through a :class:`~offload_adam.runtime.pinned.PinnedArena`."""
        ...

    def host_empty(self, n: int, dtype: torch.dtype) -> Tensor:
        """``n`` elements of host memory not yet touched (no page resident) nor pinned, to fill
        and then :meth:`pin`: a buffer as large as a model is filled while the model's own
        tensors are freed, so that the host never holds both (pinning zeroed memory first would)."""
        ...

    def pin(self, t: Tensor) -> None:
        """Pins (registers) the whole storage of ``t``, a :meth:`host_empty` buffer: from then on
        it is a :meth:`host_buffer` like any other."""
        ...

    def staging(self, like: Tensor) -> Tensor:
        """A host tensor shaped like ``like``, for one asynchronous copy."""
        ...

    def copy(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        """Queues ``dst.copy_(src)`` for each pair on ``stream``. The host side (the destination
        of a copy on ``d2h``, the source of one on ``h2d`` or ``h2d_now``) is pinned host memory: a pageable one
        is staged by the driver, which blocks the calling thread."""
        ...

    def copy_blocking(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        """:meth:`copy`, then the host waits for it: the cold paths (filling the device, handing
        weights back), whose host side may be ordinary (pageable) memory."""
        ...

    def empty(self, n: int, dtype: torch.dtype, meter: Meter | None = None) -> Tensor:
        """``n`` uninitialized elements of device memory, counted by ``meter``."""
        ...

    def record(self, stream: Any, timing: bool = False) -> Any:
        """``timing``: the event can be measured with :meth:`elapsed`."""
        ...

    def record_current(self, timing: bool = False) -> Any: ...

    def elapsed(self, start: Any, end: Any) -> float | None:
        """Seconds from ``start`` to ``end`` (timing events) once both completed, else None."""
        ...

    def stream_waits(self, stream: Any, event: Any) -> None: ...

    def current_waits(self, event: Any) -> None: ...

    def host_wait(self, event: Any) -> None: ...

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed (None: yes). Never waits."""
        ...

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        """``t`` (a device tensor its owner is about to drop) stays allocated until the work
        queued on ``stream`` so far has completed (``Tensor.record_stream``)."""
        ...

    def thread_context(self) -> contextlib.AbstractContextManager[None]:
        """Entered by a worker thread before it queues device work."""
        ...

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (host-driven copies and waits
        cannot be captured)."""
        ...

    def drain(self) -> None:
        """Blocks until everything queued on the side streams has completed."""
        ...

    def synchronize(self) -> None:
        """Blocks until everything queued on the device has completed: the side streams and every
        compute stream, the user's own included (a cold path: ``close()``)."""
        ...


class Meter:
    """Counts the device memory allocated through it (``Device.empty``): bytes held now, and the
    most held at once. A tensor counts until its storage is garbage."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._lock = threading.Lock()

    def track(self, t: Tensor) -> Tensor:
        n = t.untyped_storage().nbytes()
        with self._lock:
            self.current += n
            self.peak = max(self.peak, self.current)
        weakref.finalize(t.untyped_storage(), self._free, n)
        return t

    def _free(self, n: int) -> None:
        with self._lock:
            self.current -= n


def on_device(cuda: Any, device: Any) -> contextlib.AbstractContextManager[Any]:
    """CUDA calls inside run with ``device`` current (``cuda`` is ``torch.cuda``, or a model of it
    for tests): what creates no context elsewhere, and what ``cudaHostRegister`` needs."""
    return cuda.device(device)  # type: ignore[no-any-return]


@contextlib.contextmanager
def on_stream(cuda: Any, device: Any, stream: Any) -> Iterator[None]:
    """Work queued inside goes to ``stream`` of ``device``. The device guard comes first: leaving
    ``cuda.stream`` alone sets the device current when it was entered (``_cuda_setStream`` calls
    ``set_device``), which in a thread that never chose one is device 0: a context there."""
    with on_device(cuda, device), cuda.stream(stream):
        yield


def _drain_then_unregister(cudart: Any, device: torch.device, ptr: int, streams: tuple[Any, ...]) -> None:
    # A buffer unregistered while a DMA still reads or writes it: the copy faults or touches
    # freed pages. Wait for the side streams first (they are the only users of the buffers).
    # Runs wherever the garbage collector does: under the buffer's device (no context on GPU 0).
    try:
        with on_device(torch.cuda, device):
            for s in streams:
                s.synchronize()
            rc = cudart.cudaHostUnregister(ptr)
        if int(rc) != 0:
            log.warning("offload_adam: cudaHostUnregister of a pinned buffer failed with CUDA error %d", int(rc))
    except Exception:  # interpreter shutdown: the CUDA context may already be gone
        pass


def refuse_capture(dev: Device, who: str) -> None:
    """Raises if the current stream is capturing a CUDA graph: ``who``'s copies and waits are
    driven from the host, so a captured graph would replay none of them."""
    if dev.capturing():
        raise RuntimeError(
            f"offload_adam: {who} cannot run inside a CUDA graph capture (its copies and waits are issued from the "
            "host at each call, and a replay would skip them); capture only what is resident, or run eagerly"
        )


def pin_error(nbytes: int, code: int) -> RuntimeError:
    """A failed ``cudaHostRegister`` of ``nbytes``, with what usually causes it."""
    return RuntimeError(
        f"offload_adam: pinning {nbytes} bytes ({nbytes / (1 << 30):.3g} GiB) of host memory failed "
        f"(cudaHostRegister, CUDA error {code}). Likely causes: the locked-memory limit (`ulimit -l`; "
        "in a container, its memlock limit or cgroup memory), or not enough free RAM for what the "
        "offload pins (optimizer state with offload='cpu', streamed weights with storage='cpu', "
        "activation pools). Put the optimizer state on NVMe (offload='nvme'), stream the weights "
        "from NVMe (storage='nvme'), or raise the limit."
    )


class CudaDevice:
    """A CUDA GPU: two side streams, blocking events, host memory pinned with cudaHostRegister."""

    def __init__(self, device: torch.device) -> None:
        self.torch_device = device
        with torch.cuda.device(device):
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            # A copy needed now must not queue behind a prefetch that waits for the compute to
            # free its slot: a stream of its own. No priority: "stream priorities have no effect
            # on host-to-device and device-to-host memory operations" (CUDA driver API); the
            # demand load still shares the copy engine and PCIe with a prefetch in flight.
            self.h2d_now = torch.cuda.Stream(device)
        self._cudart = torch.cuda.cudart()

    def host_buffer(self, n: int, dtype: torch.dtype) -> Tensor:
        # Pageable memory of exactly the size asked, then pinned: torch's pinned allocator rounds
        # every block up to a power of two.
        t = torch.zeros(n, dtype=dtype)
        self.pin(t)
        return t

    def host_empty(self, n: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(n, dtype=dtype)  # large: mmap'ed, no page resident until written

    def pin(self, t: Tensor) -> None:
        st = t.untyped_storage()
        nbytes = st.nbytes()
        if not nbytes:
            return
        # Under the buffer's device: a registration from a thread whose current device is 0
        # would create a context on GPU 0 for a model on cuda:N.
        with on_device(torch.cuda, self.torch_device):
            rc = self._cudart.cudaHostRegister(st.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable
        if int(rc) != 0:
            raise pin_error(nbytes, int(rc))
        # On the storage, not this tensor: a client may keep only views of it.
        streams = (self.d2h, self.h2d, self.h2d_now)
        weakref.finalize(st, _drain_then_unregister, self._cudart, self.torch_device, st.data_ptr(), streams)

    def staging(self, like: Tensor) -> Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def copy(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        with on_stream(torch.cuda, self.torch_device, stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def copy_blocking(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        self.copy(pairs, stream)
        self.host_wait(self.record(stream))

    def empty(self, n: int, dtype: torch.dtype, meter: Meter | None = None) -> Tensor:
        t = torch.empty(n, dtype=dtype, device=self.torch_device)
        return meter.track(t) if meter is not None else t

    def record(self, stream: Any, timing: bool = False) -> Any:
        # Blocking: a host wait sleeps instead of spinning a core.
        e = torch.cuda.Event(blocking=True, enable_timing=timing)
        e.record(stream)
        return e

    def record_current(self, timing: bool = False) -> Any:
        return self.record(torch.cuda.current_stream(self.torch_device), timing)

    def elapsed(self, start: Any, end: Any) -> float | None:
        if not (start.query() and end.query()):
            return None
        return float(start.elapsed_time(end)) / 1e3

    def stream_waits(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    def current_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(event)

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        t.record_stream(stream)

    @contextlib.contextmanager
    def thread_context(self) -> Iterator[None]:
        # A new thread's current device is 0; leaving torch.cuda.stream() there would create a
        # context on GPU 0 for a model on cuda:N.
        with on_device(torch.cuda, self.torch_device):
            yield

    def capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def drain(self) -> None:
        with on_device(torch.cuda, self.torch_device):
            self.d2h.synchronize()
            self.h2d.synchronize()
            self.h2d_now.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)


class HostDevice:
    """The CPU as the device a model runs on (``offload_weights(device="cpu")``, or no GPU): its
    memory is the host's, its work runs on the calling thread. Nothing is copied to it (a block
    runs from its host bytes), so there are no side streams; events are complete at once."""

    torch_device = torch.device("cpu")
    d2h = h2d = h2d_now = None

    def host_buffer(self, n: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(n, dtype=dtype)

    def host_empty(self, n: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(n, dtype=dtype)

    def pin(self, t: Tensor) -> None:
        pass  # nothing copies from it asynchronously

    def staging(self, like: Tensor) -> Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    def copy(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def copy_blocking(self, pairs: Sequence[tuple[Tensor, Tensor]], stream: Any) -> None:
        self.copy(pairs, stream)

    def empty(self, n: int, dtype: torch.dtype, meter: Meter | None = None) -> Tensor:
        t = torch.empty(n, dtype=dtype)
        return meter.track(t) if meter is not None else t

    def record(self, stream: Any, timing: bool = False) -> Any:
        return None

    def record_current(self, timing: bool = False) -> Any:
        return None

    def elapsed(self, start: Any, end: Any) -> float | None:
        return 0.0

    def stream_waits(self, stream: Any, event: Any) -> None:
        pass

    def current_waits(self, event: Any) -> None:
        pass

    def host_wait(self, event: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def keep_until_done(self, t: Tensor, stream: Any) -> None:
        pass

    def thread_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def capturing(self) -> bool:
        return False

    def drain(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


HOST = HostDevice()


# -- one device per torch device ----------------------------------------------------------------

_cuda: dict[int, CudaDevice] = {}
_cuda_lock = threading.Lock()
_installed: ContextVar[Device | None] = ContextVar("offload_adam_installed_device", default=None)


def device_for(dev: torch.device) -> Device | None:
    """The process's :class:`Device` for ``dev``: the one :class:`CudaDevice` of a CUDA device;
    the device installed by :func:`use_device` for its own device type (the test suite's
    simulated GPU); else None for the CPU (CPU tensors are host memory). Other device types
    raise."""
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        with _cuda_lock:
            d = _cuda.get(index)
            if d is None:
                d = _cuda[index] = CudaDevice(torch.device("cuda", index))
            return d
    installed = _installed.get()
    if installed is not None and installed.torch_device.type == dev.type and dev.index in (None, installed.torch_device.index):
        return installed
    if dev.type == "cpu":
        return None
    raise ValueError(f"{dev}: not supported (CPU or CUDA)")


def default_device() -> Device | None:
    """The accelerator a client streams to when it is given none: the device installed by
    :func:`use_device` (the test suite's simulated GPU), else the current CUDA device, else None."""
    installed = _installed.get()
    if installed is not None:
        return installed
    if torch.cuda.is_available():
        return device_for(torch.device("cuda", torch.cuda.current_device()))
    return None


@contextlib.contextmanager
def use_device(dev: Device) -> Iterator[Device]:
    """Inside, ``dev`` is an accelerator of its own device type (``dev.torch_device``): tensors
    there are its memory, and it is the default device, as the GPU is on a GPU machine. What is
    built here (an optimizer, an offload of weights) keeps using it afterwards."""
    token = _installed.set(dev)
    try:
        yield dev
    finally:
        _installed.reset(token)


def stream_device(device: Any, why: str) -> Device:
    """The Device a client streams to: ``device`` (an accelerator), or by default
    :func:`default_device`. ``why`` ends the error where there is none ("offload_weights streams
    weights to a GPU")."""
    if device is None:
        dev = default_device()
        if dev is None:
            raise ValueError(f"device: no CUDA device here ({why})")
        return dev
    d = torch.device(device)
    if d.type == "cpu" and device_for(d) is None:
        raise ValueError(f"device: {d} is not a CUDA device")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: no CUDA device here ({why})")
    try:
        dev = device_for(d)
    except ValueError:
        raise ValueError(f"device: {d} is not a CUDA device") from None
    assert dev is not None
    return dev


def tensor_type(dev: Device | None) -> type:
    """The class of ``dev``'s own tensors: ``torch.Tensor``, unless the device's tensors are a
    Python subclass (the simulated GPU names it, ``tensor_type``), which the runtime then takes
    for plain tensors, not for wrapped (quantized) ones."""
    return getattr(dev, "tensor_type", Tensor)


def storage_address(t: Tensor) -> int:
    """The address of ``t``'s storage, wherever it is asked: inside an operator (a saved-tensor
    hook, which autograd calls there) torch functions of tensor subclasses are off, and a device
    whose tensors are Python subclasses (the test suite's simulated GPU) answers only through its
    own; on the CPU and CUDA the plain ``t.untyped_storage().data_ptr()``."""
    with torch._C._EnableTorchFunction():
        return int(t.untyped_storage().data_ptr())


def data_address(t: Tensor) -> int:
    """The address of ``t``'s first element (see :func:`storage_address`)."""
    with torch._C._EnableTorchFunction():
        return int(t.data_ptr())


def set_data(t: Tensor, data: Tensor) -> None:
    """``t.data = data``, also where torch refuses it because the two are tensors of different
    kinds: a device whose tensors are a Python subclass (the test suite's simulated GPU) against
    a CPU tensor. On CUDA (dense tensors on both sides) it is always the plain assignment; where
    it is refused, ``t``'s contents are swapped (:func:`swap`) for a tensor of ``data``'s kind."""
    if torch._has_compatible_shallow_copy_type(t, data):
        t.data = data
        return
    swap(t, torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data.detach())


def swap(t: Tensor, new: Tensor) -> None:
    """``t`` takes ``new``'s tensor and class while the Python object stays, and with it every
    module holding it, every tie and its attributes: ``torch.utils.swap_tensors`` without its
    check of weak references (the offload keeps the parameters it hosts, and the native matmul
    its verdicts, in weak registries keyed by identity, which is what stays). The attributes the
    old class itself declares (a subclass's, with its memory) go with the old contents."""
    kind = vars(type(t)).get("__annotations__", {}) if type(t) not in (Tensor, torch.nn.Parameter) else {}
    mine, theirs = dict(t.__dict__), dict(new.__dict__)
    t.__class__, new.__class__ = new.__class__, t.__class__
    torch._C._swap_tensor_impl(t, new)
    t.__dict__.clear()
    t.__dict__.update({**{k: v for k, v in mine.items() if k not in kind}, **theirs})
    new.__dict__.clear()
    new.__dict__.update(mine)  # (what ``t`` was, whole: swapping back restores it)
