"""The matmul of CPU-executed linear layers at decode, in the Rust core (``_native.linear``).

A CPU-executed block at decode multiplies one row (up to a few tens, below the crossover at which
a prompt is better streamed) by every weight once per token: memory-bound, if the kernel converts
a weight faster than the memory delivers it. torch's CPU paths do not for quantized weights
(torchao's int8 weight-only decode runs 13x slower than bf16). This module runs such layers
through the native kernel, reading the weights in the layout they are stored and streamed in:

- ``bf16``: a plain bfloat16 ``[out, in]`` weight;
- ``int8``: int8 ``qdata [out, in]`` with one scale per output row (or one for the tensor):
  ``w = qdata * scale`` (a zero point, if the tensor has one, must be all zeros);
- ``fp8``: float8_e4m3fn ``qdata`` with its scale likewise;
- ``int4``: torchao's CPU int4 weight-only format (``Int4OpaqueTensor``, made by
  ``torchao.prototype.quantization.int4.PrototypeInt4WeightOnlyConfig``): uint8 ``qdata`` of two
  codes per byte as torch's ``_convert_weight_to_int4pack_for_cpu`` packs them (its layout follows
  torch's CPU capability: ``int4_layout``), ``scale_and_zero`` ``[in / group, out, 2]``,
  ``w = (q - 8) * scale + zero`` per group of ``in`` (torch's ``_weight_int4pack_mm_for_cpu``).

A quantized weight is recognised by what it flattens to (``__tensor_flatten__``: inner tensors
named ``qdata`` and ``scale``, or ``qdata`` and ``scale_and_zero`` with a ``block_size`` of one
group per row, their dtypes and shapes), never by its class, and only as a weight-only format: a
flatten context asking for activation quantization is not ours to run.

The kernel computes ``(sum of float32 products) * scale + bias`` in float32 and rounds once to
the activations' dtype (float32 or bfloat16); the Rust tests hold it to a float64 reference
within ``gamma_(in+4) * sum|x w s|`` (plus half a bfloat16 ulp for bfloat16 outputs); int4
weights within ``gamma_(in+group+4) * (sum |x| (|q - 8| |scale| + |zero|) + |bias|)``, the kernel
summing each group first (``linear/int4.rs``).

``linear_rows`` is the ``torch.library`` custom op (``offload_adam::linear_rows``) over the
kernel; ``linear`` its typed entry (``linear_int4_rows`` and ``linear_int4`` for int4 weights); ``weight_parts(weight)`` what the kernel reads of a weight
(or why it cannot); ``NativeMatmul`` is the torch-function mode that sends each ``F.linear`` it
sees to the kernel where the kernel applies (``offload_weights`` enters it around the blocks that
run on the CPU: ``placement.HostCalls``; the benches and tests enter it around a model).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .. import _native

Kind = Literal["bf16", "int8", "fp8", "int4"]

# Rows at or below which a CPU-executed linear runs the native kernel: decode, and prompts short
# enough that they are not better streamed to a GPU. On this project's AVX2 machine the kernel led
# torch's bf16 and torchao's int8 linear at every row count up to 64 (``python -m offload_adam
# bench --linear``, its rows table); 16 keeps it to the few rows it is built for.
MAX_ROWS = 16

# Whether the kernel's blocks run on torch's own OpenMP team (``_native.linear(..., omp=True)``:
# libgomp's ``GOMP_parallel`` resolved from the process, issue 35 point 2) instead of the kernel's
# rayon pool, which competes with torch's spinning OpenMP workers inside a model. The same bits
# either way. On where the process has the team: on the quiet Zen 4 VM (load 0.4-1.1) the 8B-class
# model decoded 1.45x (int8) and 1.88x (int4) faster on it than on the pool (``bench --linear
# --linear-model``, 4 interleaved rounds, ranges apart). Under a load of 4-14 on 2 cores it lost
# (0.65x, 0.56x): its barrier waits for a descheduled thread (docs/benchmarks.md).
LINEAR_OMP = _native.omp_available()

_KIND_OF_DTYPE: dict[torch.dtype, Kind] = {torch.bfloat16: "bf16", torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACT_DTYPES = (torch.float32, torch.bfloat16)


def _linear_rows(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, num_threads: int) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype)
    _native.linear(x2, weight, scale, bias, out=out, num_threads=num_threads, omp=LINEAR_OMP)
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("offload_adam::linear_rows", mutates_args=(), device_types="cpu")
def linear_rows(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, num_threads: int) -> Tensor:
    """``x @ (weight * scale).T + bias`` for ``x`` of shape ``(..., in)`` on the native kernel.

    ``weight`` is bfloat16 (``scale`` None), int8 or float8_e4m3fn ``(out, in)``; every tensor a
    contiguous CPU tensor, read in place. The result has ``x``'s dtype."""
    return _linear_rows(x, weight, scale, bias, num_threads)


@linear_rows.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, num_threads: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _threads(x: Tensor, num_threads: int | None) -> int:
    """``linear``'s and ``linear_int4``'s checks of ``x`` and ``num_threads``: the threads to run on
    (default ``torch.get_num_threads()``)."""
    if x.dim() < 1:
        raise ValueError("x: must have at least one dimension")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"num_threads: must be at least 1, got {threads}")
    return threads


def _eager(x: Tensor) -> bool:
    """Eager: the op's own implementation is called, without the dispatcher's round trip (about
    30 us a call, measured here; a token calls it for every Linear); traced code (compile, export,
    fake tensors) sees the op."""
    return type(x) in (Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()


def linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor | None = None,
    bias: Tensor | None = None,
    kind: Kind | None = None,
    *,
    num_threads: int | None = None,
) -> Tensor:
    """``F.linear`` of ``x`` against stored weights: ``weight`` bfloat16 (``kind="bf16"``), int8
    (``"int8"``) or float8_e4m3fn (``"fp8"``) ``(out, in)``, ``scale`` one per output row (or one)
    for the quantized kinds. ``kind`` (if given) must match ``weight``'s dtype. Threads default to
    ``torch.get_num_threads()``. Bad arguments raise ``TypeError``/``ValueError`` naming them."""
    got = _KIND_OF_DTYPE.get(weight.dtype)
    if got is None:
        raise TypeError(f"weight: dtype must be bfloat16, int8 or float8_e4m3fn, got {weight.dtype}")
    if kind is not None and kind != got:
        raise ValueError(f"kind: {kind!r} does not match weight's dtype {weight.dtype} ({got!r})")
    threads = _threads(x, num_threads)
    if _eager(x):
        return _linear_rows(x, weight, scale, bias, threads)
    out: Tensor = torch.ops.offload_adam.linear_rows(x, weight, scale, bias, threads)
    return out


# torch's CPU capabilities, as ``torch.backends.cpu.get_cpu_capability()`` names them, whose int4
# packing the kernel reads (``linear/int4.rs``'s ``Int4Layout``).
INT4_LAYOUTS = ("AVX512", "AVX2", "DEFAULT")


def int4_layout() -> str | None:
    """The layout torch packs int4 weights in here (``_convert_weight_to_int4pack_for_cpu``): its
    CPU capability, ``AVX512``, ``AVX2`` or ``DEFAULT``; None for another one (the kernel does not
    read its packing). A tensor packed under another capability is read wrongly, by torch's own
    kernel too: the capability is the process's, not the tensor's."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    return cap if cap in INT4_LAYOUTS else None


def _linear_int4_rows(
    x: Tensor, qdata: Tensor, scale_and_zero: Tensor, bias: Tensor | None, group_size: int, layout: str, num_threads: int
) -> Tensor:  # fmt: skip
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n = qdata.shape[0]
    out = torch.empty((x2.shape[0], n), dtype=x.dtype)
    _native.linear_int4(
        x2, qdata, scale_and_zero, bias, group_size=group_size, layout=layout, out=out, num_threads=num_threads, omp=LINEAR_OMP
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


@torch.library.custom_op("offload_adam::linear_int4_rows", mutates_args=(), device_types="cpu")
def linear_int4_rows(
    x: Tensor, qdata: Tensor, scale_and_zero: Tensor, bias: Tensor | None, group_size: int, layout: str, num_threads: int
) -> Tensor:  # fmt: skip
    """``F.linear`` of ``x`` (``(..., in)``) against int4 weights as torchao's CPU format holds
    them (``qdata`` uint8 ``(out, in / 2)`` packed under torch's CPU capability ``layout``,
    ``scale_and_zero`` ``(in / group_size, out, 2)``) on the native kernel. The result has
    ``x``'s dtype."""
    return _linear_int4_rows(x, qdata, scale_and_zero, bias, group_size, layout, num_threads)


@linear_int4_rows.register_fake
def _(
    x: Tensor, qdata: Tensor, scale_and_zero: Tensor, bias: Tensor | None, group_size: int, layout: str, num_threads: int
) -> Tensor:  # fmt: skip
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


def linear_int4(
    x: Tensor, qdata: Tensor, scale_and_zero: Tensor, bias: Tensor | None = None, *, group_size: int,
    num_threads: int | None = None,
) -> Tensor:  # fmt: skip
    """``F.linear`` of ``x`` against torchao's CPU int4 weights (an ``Int4OpaqueTensor``'s
    ``qdata``, ``scale_and_zero`` and ``block_size[1]`` as ``group_size``), packed in this
    process's layout (``int4_layout``). Threads default to ``torch.get_num_threads()``. Bad
    arguments raise ``TypeError``/``ValueError`` naming them."""
    layout = int4_layout()
    if layout is None:
        raise ValueError(f"qdata: torch's CPU capability {torch.backends.cpu.get_cpu_capability()} packs int4 in a layout the kernel does not read")
    threads = _threads(x, num_threads)
    if _eager(x):
        return _linear_int4_rows(x, qdata, scale_and_zero, bias, group_size, layout, threads)
    out: Tensor = torch.ops.offload_adam.linear_int4_rows(x, qdata, scale_and_zero, bias, group_size, layout, threads)
    return out


@dataclass(frozen=True)
class WeightParts:
    """A weight as the kernel reads it: ``data`` (``[out, in]``; int4: ``[out, in / 2]`` bytes)
    and, quantized, ``scale`` (int4: ``scale_and_zero``, ``[in / group_size, out, 2]``)."""

    kind: Kind
    data: Tensor
    scale: Tensor | None
    group_size: int = 0  # int4: inputs per scale and zero point


def weight_parts(weight: Tensor) -> WeightParts | str:
    """The parts of ``weight`` the kernel reads, or why it cannot (a sentence).

    A plain bfloat16 tensor is ``bf16``. A traceable wrapper subclass is read through
    ``__tensor_flatten__``: inner ``qdata`` (int8 or float8_e4m3fn, the weight's shape) and
    ``scale`` (one per output row, or one), nothing else but an all-zero ``zero_point``, and no
    activation quantization in its context."""
    if not isinstance(weight, Tensor):
        return f"not a tensor ({type(weight).__name__})"
    if weight.dim() != 2:
        return f"weight is {weight.dim()}-D, not 2-D"
    flatten = getattr(weight, "__tensor_flatten__", None)
    plain = flatten is None or type(weight) in (Tensor, torch.nn.Parameter)
    # A wrapped weight is judged by its inner tensors, where its bytes are: one rebuilt on a GPU
    # reports that device for good, while a block run on the CPU points its inner tensors at
    # host bytes (CUDA review, second pass, hazard 4).
    if plain and weight.device.type != "cpu":
        return f"weight is on {weight.device}, not the CPU"
    if plain:
        if weight.dtype != torch.bfloat16:
            return f"plain {weight.dtype} weight (the kernel reads bfloat16, int8 or fp8 weights)"
        if not weight.is_contiguous():
            return "bfloat16 weight is not contiguous"
        return WeightParts("bf16", weight.detach(), None)
    assert flatten is not None
    names, ctx = flatten()
    inner = {n: getattr(weight, n) for n in names}
    if {"qdata", "scale_and_zero"} <= set(inner) <= {"qdata", "scale_and_zero", "act_pre_scale", "qzeros", "compensation"}:
        return _int4_parts(weight, inner["qdata"], inner["scale_and_zero"])
    if set(inner) - {"qdata", "scale", "zero_point"} or not {"qdata", "scale"} <= set(inner):
        return f"{type(weight).__name__} flattens to {sorted(inner)}, not qdata and scale"
    if isinstance(ctx, dict) and ctx.get("act_quant_kwargs") is not None:
        return f"{type(weight).__name__} quantizes the activations too (not weight-only)"
    q, s = inner["qdata"], inner["scale"]
    kind = _KIND_OF_DTYPE.get(q.dtype)
    if kind not in ("int8", "fp8") or type(q) is not Tensor or type(s) is not Tensor:
        return f"qdata of dtype {q.dtype} ({type(q).__name__}): the kernel reads int8 or float8_e4m3fn"
    if not (q.is_cpu and s.is_cpu):
        return f"its inner tensors are on {q.device}, not the CPU"
    out = weight.shape[0]
    if tuple(q.shape) != tuple(weight.shape) or not q.is_contiguous():
        return f"qdata has shape {tuple(q.shape)} (contiguous: {q.is_contiguous()}), weight {tuple(weight.shape)}"
    if s.dtype not in _SCALE_DTYPES or s.numel() not in (out, 1) or not s.is_contiguous():
        return f"scale of shape {tuple(s.shape)} and dtype {s.dtype}: not one per output row"
    zp = inner.get("zero_point")
    if zp is not None and bool(zp.any()):
        return "zero_point is not all zeros (asymmetric quantization)"
    return WeightParts(kind, q, s)


def _int4_parts(weight: Tensor, q: Tensor, sz: Tensor) -> WeightParts | str:
    """``weight_parts`` of torchao's CPU int4 format (``Int4OpaqueTensor``, weight-only)."""
    name = type(weight).__name__
    if getattr(weight, "act_mapping_type", None) is not None or getattr(weight, "act_pre_scale", None) is not None:
        return f"{name} quantizes or scales the activations too (not weight-only)"
    block = getattr(weight, "block_size", None)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and block[0] == 1 and isinstance(block[1], int)):
        return f"{name} has block_size {block!r}, not one group of inputs per row"
    group = block[1]
    if int4_layout() is None:
        return f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()} packs int4 in a layout the kernel does not read"
    if type(q) is not Tensor or type(sz) is not Tensor or not (q.is_cpu and sz.is_cpu):
        return f"its inner tensors are on {q.device}, not the CPU"
    out, k = weight.shape
    if q.dtype != torch.uint8 or tuple(q.shape) != (out, k // 2) or k % 2 or not q.is_contiguous():
        return f"qdata of dtype {q.dtype} and shape {tuple(q.shape)}: not two int4 codes per byte of a ({out}, {k}) weight"
    if group < 2 or group % 2 or k % group or out % 16:
        return f"group size {group} of a ({out}, {k}) weight: the kernel reads even groups that divide in, out a multiple of 16"
    if sz.dtype not in _SCALE_DTYPES or tuple(sz.shape) != (k // group, out, 2) or not sz.is_contiguous():
        return f"scale_and_zero of shape {tuple(sz.shape)} and dtype {sz.dtype}: not (in / group, out, 2)"
    return WeightParts("int4", q, sz, group)


def best_times(ours: Callable[[], None], theirs: Callable[[], None], rounds: int) -> tuple[float, float]:
    """The best time of each of two calls over ``rounds`` interleaved rounds, no gradient: the
    one-off measurements that choose between the kernel and torch's path (:func:`bf16_faster`,
    ``experts.native_experts_faster``)."""
    best = [float("inf"), float("inf")]
    with torch.no_grad():
        for _ in range(rounds):
            for i, call in enumerate((ours, theirs)):
                t0 = time.perf_counter()
                call()
                best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


_BF16_FASTER: dict[int, bool] = {}  # threads -> whether the kernel's bfloat16 1-row matmul beat torch's here
BF16_MARGIN = 0.9  # the kernel's time must be under this fraction of torch's (bf16_faster)
_BF16_BYTES = 96 << 20  # the weights bf16_faster cycles over: 3 times a server's 32 MiB L3


def bf16_faster(threads: int, d: int = 4096, rounds: int = 5) -> bool:
    """Whether the kernel's 1-row matmul of ``d x d`` bfloat16 weights beats torch's on this
    machine with ``threads`` threads by a margin (:data:`BF16_MARGIN`), measured once per process
    and thread count (about 30 ms): calls cycle over copies of the weight of 96 MiB in all, read
    from DRAM as at decode, best of ``rounds`` passes each. The margin is what a block run on the
    kernel pays beside it (the ``NativeMatmul`` mode's Python over each torch operation: 0.24 ms
    a Llama layer, docs/benchmarks.md) and keeps a near tie from deciding by noise: on the
    project's Zen 4 VM both read DRAM at 30-33 GB/s, and the earlier choice by the plain minimum
    of a cache-resident weight could flip between processes (one ``bench --moe`` (b) round at 19
    tokens/s beside 33-34, with other rounding, is thought to be one: inferred, not read). Elsewhere one leads: on a 2-core Intel Xeon with AVX-512 BF16 torch's
    oneDNN kernel (0.67 against 0.74 ms for 4096 x 4096); on a 2-core AMD EPYC with AVX2 the
    kernel, 3-4x. Quantized weights do not need asking: torch's paths for them decode 13-20x
    slower than the kernel."""
    known = _BF16_FASTER.get(threads)
    if known is not None:
        return known
    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(d, d, generator=g) * d**-0.5).to(torch.bfloat16)
    ws = [w0] + [w0.clone() for _ in range(max(0, -(-_BF16_BYTES // (w0.numel() * 2)) - 1))]
    x = torch.randn(1, d, generator=g).to(torch.bfloat16)
    out = torch.empty(1, d, dtype=torch.bfloat16)

    def kernel() -> None:
        for w in ws:
            _native.linear(x, w, None, None, out=out, num_threads=threads, omp=LINEAR_OMP)

    def torchs() -> None:
        for w in ws:
            _LINEAR(x, w)

    ours, theirs = best_times(kernel, torchs, rounds)
    faster = ours < BF16_MARGIN * theirs
    _BF16_FASTER[threads] = faster
    return faster


_LINEAR = F.linear
_PLAIN = (Tensor, torch.nn.Parameter)


def _settled(weight: Tensor) -> bool:
    """Whether ``weight`` (a wrapper subclass) and its inner tensors are CPU tensors laid out in
    place: a verdict of ``weight_parts`` on it then holds for the object (its structure), not
    for where its bytes are now (a streamed weight's placeholder, a copy on the device)."""
    flatten = getattr(weight, "__tensor_flatten__", None)
    if flatten is None:
        return False
    names, _ = flatten()
    inner = [getattr(weight, n, None) for n in names]
    return all(type(t) is Tensor and t.is_cpu and t.is_contiguous() for t in inner)


def leave_mode(mode: TorchFunctionMode) -> None:
    """``mode`` off the torch-function mode stack, wherever it is on it: a mode entered after it
    and still active stays, in its place (``__exit__`` pops the top one, whichever it is)."""
    above: list[Any] = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


class NativeMatmul(TorchFunctionMode):
    """While active, ``F.linear`` runs on the native kernel where the kernel applies, else
    torch's (every other torch function unchanged):

    - ``x`` a plain float32 or bfloat16 CPU tensor of at most ``max_rows`` rows (``x.numel() /
      x.shape[-1]``), no gradient wanted (grad mode off, or nothing requiring one), CPU
      autocast off;
    - the weight a contiguous bfloat16 CPU tensor (``x`` bfloat16), or a wrapper subclass
      ``weight_parts`` reads (int8 or fp8 weight-only, ``x`` of the wrapper's dtype) whose inner
      tensors are contiguous CPU tensors now; the bias None or a contiguous CPU tensor of
      ``x``'s dtype, one per output.

    A mode comes before a subclass's own ``__torch_function__``, so it sees torchao's weights.
    The weight's parts are read by attribute at each call (a streamed weight's bytes move between
    calls); what ``weight_parts`` found of a subclass weight (its kind, or that the kernel cannot
    read it) is kept per object and type. A weight that is not in place (a streamed block's
    placeholder: one NaN expanded) goes to torch, where the schedule's recorder sees the read.
    ``native_calls`` and ``torch_calls`` count the ``F.linear`` calls each ran; ``on`` (default
    True) False sends every call to torch (a call nested in a CPU-run block that runs elsewhere)."""

    def __init__(self, max_rows: int = MAX_ROWS, bf16: bool = True) -> None:
        super().__init__()
        self.max_rows = max_rows
        self.bf16 = bf16  # bfloat16 weights too (not only quantized ones)
        self.on = True
        self.native_calls = 0
        self.torch_calls = 0
        # id(weight) -> (a weak reference to it, its type, its kind or None, its dtype)
        self._seen: dict[int, tuple[Any, type, Kind | None, torch.dtype]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not _LINEAR:
            return func(*args, **kwargs) if kwargs else func(*args)
        out = self._native(args, kwargs) if self.on else None
        if out is None:
            self.torch_calls += 1
            return func(*args, **kwargs) if kwargs else func(*args)
        self.native_calls += 1
        return out

    def leave(self) -> None:
        leave_mode(self)

    def _learn(self, w: Tensor) -> tuple[Any, type, Kind | None, torch.dtype]:
        parts = weight_parts(w)
        entry = (weakref.ref(w), type(w), None if isinstance(parts, str) else parts.kind, w.dtype)
        if not isinstance(parts, str) or _settled(w):  # (else a verdict on where its bytes are now)
            key = id(w)
            seen = self._seen

            def drop(ref: Any) -> None:
                if seen.get(key, (None,))[0] is ref:
                    del seen[key]

            entry = (weakref.ref(w, drop), *entry[1:])  # type: ignore[assignment]
            seen[key] = entry
        return entry

    def _native(self, args: Any, kwargs: Any) -> Tensor | None:
        """The kernel's ``F.linear(*args, **kwargs)``, or None where it does not apply."""
        if kwargs:
            if len(args) != 2 or kwargs.keys() - {"bias"}:
                return None
            bias = kwargs.get("bias")
        elif len(args) == 2:
            bias = None
        elif len(args) == 3:
            bias = args[2]
        else:
            return None
        x, w = args[0], args[1]
        if type(x) is not Tensor or not x.is_cpu or x.dim() == 0:
            return None
        dtype = x.dtype
        k = x.shape[-1]
        if dtype not in _ACT_DTYPES or not k or not 0 < x.numel() // k <= self.max_rows:
            return None
        grad = torch.is_grad_enabled()
        if (grad and x.requires_grad) or torch.is_autocast_enabled("cpu"):
            return None
        tw = type(w)
        if tw is Tensor or tw is torch.nn.Parameter:
            if not self.bf16 or w.dtype is not torch.bfloat16 or dtype is not torch.bfloat16 or not w.is_cpu or w.dim() != 2:
                return None
            if w.shape[1] != k or not w.is_contiguous() or (grad and w.requires_grad):
                return None
            data, scale = w, None
        elif isinstance(w, Tensor):
            seen = self._seen.get(id(w))
            if seen is None or seen[0]() is not w or seen[1] is not tw:
                seen = self._learn(w)
            if seen[2] is None or seen[3] is not dtype or (grad and w.requires_grad):
                return None
            if seen[2] == "int4":
                return self._int4(x, w, bias, grad)
            # Attribute reads only: the wrapper's methods go through its __torch_function__.
            data, scale = getattr(w, "qdata"), getattr(w, "scale")
            if type(data) is not Tensor or type(scale) is not Tensor or not (data.is_cpu and scale.is_cpu):
                return None
            if data.dim() != 2 or data.shape[1] != k or not (data.is_contiguous() and scale.is_contiguous()):
                return None
            if _KIND_OF_DTYPE.get(data.dtype) != seen[2] or scale.dtype not in _SCALE_DTYPES or scale.numel() not in (1, data.shape[0]):
                return None
        else:
            return None
        if bias is not None:
            if type(bias) not in _PLAIN or bias.dtype is not dtype or not bias.is_cpu or bias.dim() != 1:
                return None
            if bias.shape[0] != data.shape[0] or not bias.is_contiguous() or (grad and bias.requires_grad):
                return None
        return _linear_rows(x, data, scale, bias, torch.get_num_threads())

    def _int4(self, x: Tensor, w: Tensor, bias: Any, grad: bool) -> Tensor | None:
        """The kernel's ``F.linear`` of an int4 weight (``weight_parts``'s kind ``int4``), or None."""
        data, sz = getattr(w, "qdata"), getattr(w, "scale_and_zero")
        if type(data) is not Tensor or type(sz) is not Tensor or not (data.is_cpu and sz.is_cpu):
            return None
        n, k = w.shape
        if data.dtype != torch.uint8 or tuple(data.shape) != (n, k // 2) or not (data.is_contiguous() and sz.is_contiguous()):
            return None
        group = getattr(w, "block_size")[1]
        if sz.dtype not in _SCALE_DTYPES or tuple(sz.shape) != (k // group, n, 2) or x.shape[-1] != k:
            return None
        if bias is not None:
            if type(bias) not in _PLAIN or bias.dtype is not x.dtype or not bias.is_cpu or bias.dim() != 1:
                return None
            if bias.shape[0] != n or not bias.is_contiguous() or (grad and bias.requires_grad):
                return None
        layout = int4_layout()
        if layout is None:
            return None
        return _linear_int4_rows(x, data, sz, bias, group, layout, torch.get_num_threads())
