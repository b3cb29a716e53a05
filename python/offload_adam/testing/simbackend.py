"""The simulated device's own torch device: ``simgpu``, tensors that code can tell from host memory.

A real GPU's memory is not the host's: an operation that mixes a GPU tensor with a CPU tensor
raises, a weight left on the host crashes the first forward. A simulator whose device memory is
ordinary CPU tensors cannot see that. So the simulated device registers a device type of its own
(torch's ``PrivateUse1`` dispatch key, renamed ``simgpu``, with the device guard and hooks of
:func:`torch.utils.backend_registration._setup_privateuseone_for_python_backend`), and its
tensors are :class:`SimTensor`: a wrapper subclass that reports ``simgpu:N`` and holds its memory
as a CPU tensor (``mem``), on which every operation runs.

Why a wrapper subclass on ``PrivateUse1`` (and not one that claims ``cuda``): autograd asks the
device of a tensor for its current stream, and a wrapper that claims ``cuda`` aborts there on a
machine without a driver; ``PrivateUse1`` with a device guard registered from Python runs
autograd (the backward on a device thread of its own, as CUDA's), and a gradient lands on the
device. What it keeps of a GPU:

* **Two sides.** An operation on ``simgpu`` tensors that also takes a CPU tensor raises
  torch's "Expected all tensors to be on the same device" (a 0-dim CPU tensor excepted, as torch
  allows, and CPU indices of an indexing operation); only copies cross (``copy_``, ``.to()``,
  the device's side streams).
* **Factories and moves.** ``torch.empty(..., device="simgpu")`` (and every factory built on it)
  and ``.to("simgpu")`` put tensors there; freshly allocated memory is NaN (never initialized).
* **Identity.** ``data_ptr()`` and ``untyped_storage()`` answer for the memory (the runtime tells
  slots and rebindings apart by address, as on a GPU).
* **Autocast.** ``torch.autocast("simgpu")`` casts as CUDA's (:mod:`~offload_adam.testing.simautocast`).
* **The streams.** Each operation on device memory is reported to the :class:`SimulatedDevice` of
  its index (:func:`attach`): it honours the thread's pending stream waits first, and records
  what it reads and writes for the happens-before check.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from . import simautocast

NAME = "simgpu"


class Hooks(Protocol):
    """What a :class:`SimTensor`'s operation tells its device (the simulated device)."""

    def before_op(self, func: Any, args: Any, kwargs: Any) -> None: ...

    def after_op(self, func: Any, out: Any) -> None: ...

    def host_sync(self) -> None: ...


_hooks: dict[int, Hooks] = {}  # device index -> the simulated device whose memory it is


def attach(index: int, hooks: Hooks | None) -> None:
    """``hooks`` (a simulated device) hears every operation on ``simgpu:index`` from now on
    (None: no one does; the tensors keep working as plain memory)."""
    if hooks is None:
        _hooks.pop(index, None)
    else:
        _hooks[index] = hooks


def device(index: int = 0) -> torch.device:
    register()
    return torch.device(NAME, index)


def mem(t: Tensor) -> Tensor:
    """The CPU tensor holding a :class:`SimTensor`'s memory (its own view of it); any other
    tensor as it is."""
    return t.mem if isinstance(t, SimTensor) else t


def wrap(m: Tensor, index: int, requires_grad: bool = False) -> SimTensor:
    """A ``simgpu:index`` tensor over the CPU memory ``m`` (a view of it, shared)."""
    return SimTensor(m, index, requires_grad)


class SimTensor(Tensor):
    """A tensor of the simulated device: reports ``simgpu:N``, computes on its CPU memory."""

    mem: Tensor
    device_index: int

    @staticmethod
    def __new__(cls, m: Tensor, index: int = 0, requires_grad: bool = False) -> SimTensor:
        assert type(m) is Tensor and m.device.type == "cpu", type(m)
        r = Tensor._make_wrapper_subclass(
            cls, m.shape, strides=m.stride(), storage_offset=m.storage_offset(), dtype=m.dtype,
            device=torch.device(NAME, index), requires_grad=requires_grad,
        )  # fmt: skip
        r.mem = m
        r.device_index = index
        return r

    # ``t.data = x`` copies the tensor's metadata from ``x``; its memory lives here, so it moves too.
    @property  # type: ignore[override]
    def data(self) -> Tensor:
        return torch._C.TensorBase.data.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @data.setter
    def data(self, new: Tensor) -> None:
        torch._C.TensorBase.data.__set__(self, new)  # type: ignore[attr-defined]
        if isinstance(new, SimTensor):
            self.mem, self.device_index = new.mem, new.device_index

    # The memory's storage as a method too: code that runs inside an operation (a saved-tensor
    # hook, called while this class's torch functions are disabled) asks for it as well. (Not
    # data_ptr: torch's deepcopy tells a wrapper without memory by a data_ptr() of 0 there.)
    def untyped_storage(self) -> torch.UntypedStorage:
        return self.mem.untyped_storage()

    # A traceable wrapper subclass (its inner tensor named): ``module.to("simgpu")`` then swaps
    # each parameter's contents, the object staying, as ``.to("cuda")`` keeps it (``p.data =``);
    # without it, torch made a new parameter per module and broke tied weights.
    def __tensor_flatten__(self) -> tuple[list[str], dict[str, int]]:
        return ["mem"], {"index": self.device_index}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], ctx: dict[str, int], outer_size: Any, outer_stride: Any) -> SimTensor:
        return SimTensor(inner["mem"], ctx["index"])

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"SimTensor({self.mem!r}, device='{NAME}:{self.device_index}')"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "data_ptr" and args and isinstance(args[0], SimTensor):
            return args[0].mem.data_ptr()
        if name == "untyped_storage" and args and isinstance(args[0], SimTensor):
            return args[0].mem.untyped_storage()
        if any(not issubclass(t, SimTensor) and t not in (Tensor, torch.nn.Parameter) for t in types):
            return NotImplemented  # another subclass's (a quantized weight over device tensors): its own first
        if func is Tensor.tolist:  # (torch refuses it for a subclass; a CUDA tensor's copies to the host)
            return args[0].cpu().tolist()
        if func in _AS_THE_CPU:
            return _as_the_cpu(func, args, kwargs)
        if func is Tensor.backward:
            # Not under DisableTorchFunctionSubclass: the backward's thread inherits this thread's
            # state, and the subclasses its nodes meet (a quantized weight) need their own.
            return _backward(*args, **kwargs)
        if func is torch.autograd.grad:
            with _raising(), torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.autograd.backward:
            return _backward(
                args[0] if args else kwargs["tensors"], kwargs.get("grad_tensors", args[1] if len(args) > 1 else None),
                kwargs.get("retain_graph"), kwargs.get("create_graph", False), kwargs.get("inputs"),
            )  # fmt: skip
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        return _dispatch(func, args, kwargs or {})


# -- operations -----------------------------------------------------------------------------------


def _backward(
    t: Tensor | Sequence[Tensor], gradient: Any = None, retain_graph: bool | None = None, create_graph: bool = False, inputs: Any = None
) -> None:
    """``torch.autograd.backward`` past its own torch-function check (which would bring it back
    here), with subclasses' torch functions on: every tensor with its gradient (it took the
    first of a list only, and the other tensors got none)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple  # type: ignore[attr-defined]
    from torch.autograd.graph import _engine_run_backward

    tensors = (t,) if isinstance(t, Tensor) else tuple(t)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(gradient, len(tensors)), is_grads_batched=False)
    inputs_tuple = () if inputs is None else (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    with _raising():
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph, inputs_tuple, allow_unreachable=True, accumulate_grad=True)


# Operations whose kernel torch picks by device type: on the simulated device they run the CPU's
# choice on the memory (a ``simgpu`` tensor computes as the CPU would, so a block run on the CPU
# and the same block on the device give the same bits, as the tests of placements assert).
_AS_THE_CPU = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


class _CpuCall(torch.autograd.Function):
    """``fn`` run on the CPU memory of its tensor arguments, its result back on the device. What
    the backward needs is saved as the device tensors themselves (``save_for_backward``: a
    saved-tensor hook sees them as on a GPU, where the attention saves its device inputs; a
    graph kept on the CPU memory showed it host tensors), and the backward recomputes ``fn`` on
    them (the CPU's kernels are deterministic: the same bits) to take its gradients."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], index: int, *tensors: Tensor) -> Any:  # type: ignore[override]
        hooks = _hooks.get(index)
        if hooks is not None:
            hooks.before_op(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, tuple(tensors[:3]), {})
        with torch.no_grad():
            out = fn(*[mem(t).detach() for t in tensors])
        ctx.save_for_backward(*tensors)
        ctx.fn = fn
        ctx.index = index
        return SimTensor(out.detach(), index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        tensors = ctx.saved_tensors
        hooks = _hooks.get(ctx.index)
        if hooks is not None:
            hooks.before_op(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default, (grad, *tensors[:3]), {})
        needs = ctx.needs_input_grad[2:]
        inputs = [mem(t).detach().requires_grad_(bool(n) and t.is_floating_point()) for t, n in zip(tensors, needs)]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        got = iter(torch.autograd.grad(out, wanted, mem(grad)) if wanted else ())
        return (None, None, *[SimTensor(next(got), ctx.index) if t.requires_grad else None for t in inputs])


def _as_the_cpu(func: Any, args: Any, kwargs: Any) -> Any:
    args, kwargs = simautocast.cast_for_attention(args, kwargs, NAME)  # what autocast gives the kernel
    flat = list(args) + list(kwargs.values())
    where = [i for i, x in enumerate(flat) if isinstance(x, Tensor)]
    index = _index_of(args, kwargs)
    for i in where:
        t = flat[i]
        if not isinstance(t, SimTensor) and t.dim() > 0:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {NAME}:{index} and cpu!")
    keys = list(kwargs)

    def fn(*tensors: Tensor) -> Tensor:
        vals = list(flat)
        for i, t in zip(where, tensors):
            vals[i] = t
        return func(*vals[: len(args)], **dict(zip(keys, vals[len(args) :])))  # type: ignore[no-any-return]

    return _CpuCall.apply(fn, index, *[flat[i] for i in where])


# Operations that take tensors of both sides by design: copies, and the CPU indices of indexing.
_CROSSING = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize"}
_CPU_INDICES = {"aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_put"}


def _index_of(args: Any, kwargs: Any) -> int:
    for x in (*args, *kwargs.values()):
        if isinstance(x, SimTensor):
            return x.device_index
        if isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, SimTensor):
                    return y.device_index
    return 0


def _check_sides(func: Any, args: Any, kwargs: Any, index: int) -> None:
    name = func._schema.name
    if name in _CROSSING:
        return
    for i, a in enumerate(func._schema.arguments):
        x = args[i] if i < len(args) else kwargs.get(a.name)
        xs = x if isinstance(x, (list, tuple)) else (x,)
        for t in xs:
            if isinstance(t, Tensor) and not isinstance(t, SimTensor) and t.device.type == "cpu" and t.dim() > 0:
                if name in _CPU_INDICES and a.name == "indices":
                    continue
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, {NAME}:{index} and "
                    f"cpu! (when checking argument {a.name} of {name.removeprefix('aten::')})"
                )


def _to_cpu(x: Any) -> Any:
    if isinstance(x, SimTensor):
        return x.mem
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    return x


def _dispatch(func: Any, args: Any, kwargs: Any) -> Any:
    name = func._schema.name
    index = _index_of(args, kwargs)
    hooks = _hooks.get(index)
    if name == "aten::_has_compatible_shallow_copy_type":
        return all(isinstance(t, SimTensor) for t in args[:2])
    if name == "aten::record_stream":  # (the memory is the host's, freed when the last reference goes)
        return None
    _check_sides(func, args, kwargs, index)
    if hooks is not None:
        hooks.before_op(func, args, kwargs)
    if name == "aten::_to_copy":
        d = kwargs.get("device")
        if d is not None and torch.device(d).type == "cpu":  # to the host: a synchronous copy
            out = func(_to_cpu(args[0]), **kwargs)
            if hooks is not None:
                hooks.host_sync()
            return out
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        mem(dst).copy_(mem(src))
        if hooks is not None:
            hooks.after_op(func, dst)
            if not isinstance(dst, SimTensor):  # to the host: the host waits for it
                hooks.host_sync()
        return dst
    out = func(*tree_map(_to_cpu, args), **tree_map(_to_cpu, kwargs))
    out = _wrap_outputs(func, args, kwargs, out, index)
    if hooks is not None:
        hooks.after_op(func, out)
        if name == "aten::_local_scalar_dense":  # .item(): the host waits for the stream
            hooks.host_sync()
    return out


def _wrap_outputs(func: Any, args: Any, kwargs: Any, out: Any, index: int) -> Any:
    """CPU results back as ``simgpu`` tensors; an in-place operation returns its own argument."""
    returns = func._schema.returns
    arguments = func._schema.arguments
    mutated: dict[str, Any] = {}
    for i, a in enumerate(arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            mutated[str(a.alias_info)] = args[i] if i < len(args) else kwargs.get(a.name)

    def back(x: Any) -> Any:
        if isinstance(x, Tensor) and type(x) is Tensor and x.device.type == "cpu":
            return SimTensor(x, index)
        return x

    if len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write:
        same = mutated.get(str(returns[0].alias_info))
        if isinstance(same, SimTensor):
            return same
    if isinstance(out, tuple) and len(out) == len(returns):
        return tuple(
            mutated[str(r.alias_info)]
            if r.alias_info is not None and r.alias_info.is_write and isinstance(mutated.get(str(r.alias_info)), SimTensor)
            else tree_map(back, o)
            for r, o in zip(returns, out)
        )
    return tree_map(back, out)


# -- the backend ----------------------------------------------------------------------------------

_registered = False
_lib: Any = None


class _Module:
    """``torch.simgpu``: what torch asks of a device's module. Available only while a simulated
    device is attached: code that looks for an accelerator (FSDP2's default device, distributed
    checkpointing's loader) sees none otherwise."""

    def is_available(self) -> bool:
        return bool(_hooks)

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return max(_hooks, default=0) + 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    def synchronize(self, device: Any = None) -> None:
        pass

    # Streams and events, for the code that asks a device's module for them (distributed
    # checkpointing's loader, FSDP2): torch's own, through the device guard, where each stream is
    # the device's one compute stream. The simulated device's compute runs in program order on
    # the host, so their waits order nothing that is not ordered already (its side streams, the
    # hazards it checks, are its Device interface's).

    def current_stream(self, device: Any = None) -> torch.Stream:
        return torch.Stream(device=torch.device(NAME, _device_index(device)))

    def Stream(self, device: Any = None, priority: int = 0, **kw: Any) -> torch.Stream:  # noqa: N802 (torch's name)
        return torch.Stream(device=torch.device(NAME, _device_index(device)), priority=priority)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:  # noqa: N802
        return _Event(device=torch.device(NAME, 0), enable_timing=enable_timing)

    def stream(self, s: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(s)

    def set_device(self, device: Any) -> None:
        pass

    def device(self, device: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class _Event(torch.Event):
    """An event of the device's compute stream: complete when recorded (torch's guard for a
    Python backend cannot synchronize one)."""

    def synchronize(self) -> None:
        pass


def _hook_base() -> Any:
    from torch.utils.backend_registration import _DummyPrivateUse1Hook

    return _DummyPrivateUse1Hook


class _Hook(_hook_base()):  # type: ignore[misc]
    def is_available(self) -> bool:
        return bool(_hooks)


# -- a backward that raises -----------------------------------------------------------------------
#
# A Python exception raised inside a backward (a tensor hook, a saved-tensor hook) leaves the
# thread's Python error indicator set while torch's C++ unwinds (``throw python_error()``; the
# engine fetches the error only later, in ``PythonEngine::thread_on_exception``). On the way out
# the node's stream guard (``c10::OptionalStreamGuard`` in ``Engine::evaluate_function``, there
# for every node on the accelerator's device type, which ``simgpu`` is) restores the stream:
# ``PythonDeviceGuard::exchangeStream`` (``torch/csrc/acc/Module.cpp``, noexcept) calls
# ``type()``, a pybind11 override that calls the guard's ``type_`` in Python; with the error still
# set that call fails ("returned a result with an exception set"), the C++ exception leaves a
# noexcept function, and std::terminate aborts the process (torch 2.15). So the device guard's
# ``type_`` takes a pending error off the thread (a ctypes call into the C API surfaces it as a
# Python exception, caught here), keeps it, and lets the unwinding finish; the engine then
# reports an error whose Python exception is gone (a SystemError: "returned NULL without setting
# an exception"), and :func:`_raising` raises the kept exception in its place, as on a GPU.

_pending: list[BaseException] = []  # errors taken off a backward's thread, last first out
_probe = ctypes.pythonapi.Py_IsInitialized  # any C-API call: ctypes raises an error it finds set


def _guard_base() -> Any:
    return torch._C._acc.DeviceGuard


class _Guard(_guard_base()):  # type: ignore[misc]
    """The device guard of ``simgpu``: torch's for a Python backend, that survives a backward
    that raises (see above)."""

    def type_(self) -> Any:
        try:
            _probe()
        except BaseException as e:  # noqa: BLE001 (the backward's error, whatever it is: kept)
            _pending.append(e)
        return torch._C._autograd.DeviceType.PrivateUse1


@contextlib.contextmanager
def _raising() -> Iterator[None]:
    """Around the autograd engine: an error a backward raised on the device, as raised (the
    engine's SystemError in its place otherwise; see above)."""
    _pending.clear()
    try:
        yield
    except SystemError:
        if not _pending:
            raise
        e = _pending.pop()
        _pending.clear()
        raise e from None
    finally:
        _pending.clear()


def _fresh(size: Any, dtype: torch.dtype | None, stride: Any = None) -> Tensor:
    dtype = dtype or torch.get_default_dtype()
    m = torch.empty(size, dtype=dtype) if stride is None else torch.empty_strided(size, stride, dtype=dtype)
    # Never initialized: NaN, or for integers a pattern that reads as garbage.
    m.fill_(float("nan") if dtype.is_floating_point or dtype.is_complex else (0xA5 if dtype == torch.uint8 else -1 if dtype != torch.bool else True))
    return m


def _device_index(device: Any) -> int:
    if device is None:
        return 0
    d = torch.device(device)
    return d.index if d.index is not None else 0


def _cpu_kernels_over_composites() -> list[str]:
    """The aten operations with a kernel of the CPU's beside a composite one
    (``CompositeImplicitAutograd``): ``silu_backward``, ``mish_backward``,
    ``native_channel_shuffle`` in torch 2.15. A device type without a kernel of its own takes the
    composite, decomposed above autograd, before ``SimTensor`` sees the call (``silu_backward``:
    sigmoid and products, other bits than the CPU's kernel); with one registered for
    ``PrivateUse1`` the dispatcher leaves the composite out, as for the CPU and CUDA, and the
    call reaches ``SimTensor``, which runs the CPU's kernel on the memory."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return sorted(
        n for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and has(n, "CompositeImplicitAutograd") and has(n, "CPU")
    )  # fmt: skip


def _own_kernel(op: str) -> Callable[..., Any]:
    name, _, overload = op.split("::", 1)[1].partition(".")
    packet = getattr(torch.ops.aten, name)
    func = getattr(packet, overload or "default")

    def kernel(*args: Any, **kwargs: Any) -> Any:  # (never reached: SimTensor's dispatch is above it)
        return _dispatch(func, args, kwargs)

    return kernel


def register() -> None:
    """Registers ``simgpu`` in this process, once (torch allows one renamed PrivateUse1)."""
    global _registered, _lib
    if _registered:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() != NAME:
        _setup_privateuseone_for_python_backend(NAME, backend_module=_Module(), hook=_Hook(), device_guard=_Guard())
    _lib = torch.library.Library("aten", "IMPL")

    def empty_memory_format(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None, memory_format: Any = None) -> Tensor:
        return SimTensor(_fresh(size, dtype), _device_index(device))

    def empty_strided(size: Any, stride: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None) -> Tensor:
        return SimTensor(_fresh(size, dtype, stride), _device_index(device))

    def copy_from(src: Tensor, dst: Tensor, non_blocking: bool = False) -> Tensor:
        return _dispatch(torch.ops.aten.copy_.default, (dst, src), {})

    impls: list[tuple[str, Callable[..., Any]]] = [
        ("empty.memory_format", empty_memory_format),
        ("empty_strided", empty_strided),
        ("_copy_from", copy_from),
    ]
    for op, fn in impls:
        _lib.impl(op, fn, "PrivateUse1")
    for op in _cpu_kernels_over_composites():
        _lib.impl(op.split("::", 1)[1], _own_kernel(op), "PrivateUse1")
    simautocast.register(NAME)
    _registered = True
