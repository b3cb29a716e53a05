"""The matmul of CPU-executed linear layers at decode, in the Rust core (``_native.linear``).

A CPU-executed block at decode multiplies one row (up to a few tens, below the crossover at which
a prompt is better streamed) by every weight once per token: memory-bound, if the kernel converts
a weight faster than the memory delivers it. torch's CPU paths do not for quantized weights
(torchao's int8 weight-only decode runs 13x slower than bf16). This module runs such layers
through the native kernel, reading the weights in the layout they are stored and streamed in:

- ``bf16``: a plain bfloat16 ``[out, in]`` weight;
- ``int8``: int8 ``qdata [out, in]`` with one scale per output row (or one for the tensor):
  ``w = qdata * scale`` (a zero point, if the tensor has one, must be all zeros);
- ``fp8``: float8_e4m3fn ``qdata`` with its scale likewise.

A quantized weight is recognised by what it flattens to (``__tensor_flatten__``: inner tensors
named ``qdata`` and ``scale``, their dtypes and shapes), never by its class, and only as a
weight-only format: a flatten context asking for activation quantization is not ours to run.

The kernel computes ``(sum of float32 products) * scale + bias`` in float32 and rounds once to
the activations' dtype (float32 or bfloat16); the Rust tests hold it to a float64 reference
within ``gamma_(in+4) * sum|x w s|`` (plus half a bfloat16 ulp for bfloat16 outputs).

``linear_rows`` is the ``torch.library`` custom op (``offload_adam::linear_rows``) over the
kernel; ``linear`` its typed entry; ``native_linear(module)`` says whether a layer can run it
(``NativeLinear``, or None) and runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .. import _native

Kind = Literal["bf16", "int8", "fp8"]

# Rows at or below which a CPU-executed linear runs the native kernel: decode, and prompts short
# enough that they are not better streamed to a GPU. On this project's AVX2 machine the kernel led
# torch's bf16 and torchao's int8 linear at every row count up to 64 (``python -m offload_adam
# bench --linear``, its rows table); 16 keeps it to the few rows it is built for.
MAX_ROWS = 16

_KIND_OF_DTYPE: dict[torch.dtype, Kind] = {torch.bfloat16: "bf16", torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACT_DTYPES = (torch.float32, torch.bfloat16)


def _linear_rows(x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, num_threads: int) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype)
    _native.linear(x2, weight, scale, bias, out=out, num_threads=num_threads)
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
    if x.dim() < 1:
        raise ValueError("x: must have at least one dimension")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"num_threads: must be at least 1, got {threads}")
    if type(x) in (Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling():
        # Eager: the op's own implementation, without the dispatcher's round trip (about 30 us
        # a call, measured here; a token calls it for every Linear); traced code (compile, export,
        # fake tensors) sees the op.
        return _linear_rows(x, weight, scale, bias, threads)
    out: Tensor = torch.ops.offload_adam.linear_rows(x, weight, scale, bias, threads)
    return out


@dataclass(frozen=True)
class WeightParts:
    """A weight as the kernel reads it: ``data`` (``[out, in]``) and, quantized, ``scale``."""

    kind: Kind
    data: Tensor
    scale: Tensor | None


def weight_parts(weight: Tensor, *, check_values: bool = True) -> WeightParts | str:
    """The parts of ``weight`` the kernel reads, or why it cannot (a sentence).

    A plain bfloat16 tensor is ``bf16``. A traceable wrapper subclass is read through
    ``__tensor_flatten__``: inner ``qdata`` (int8 or float8_e4m3fn, the weight's shape) and
    ``scale`` (one per output row, or one), nothing else but an all-zero ``zero_point``, and no
    activation quantization in its context. ``check_values=False`` skips reading the zero point
    (a call of a layer ``native_linear`` accepted: its bytes do not change, only where they are)."""
    if not isinstance(weight, Tensor):
        return f"not a tensor ({type(weight).__name__})"
    if weight.dim() != 2:
        return f"weight is {weight.dim()}-D, not 2-D"
    if weight.device.type != "cpu":
        return f"weight is on {weight.device}, not the CPU"
    flatten = getattr(weight, "__tensor_flatten__", None)
    if flatten is None or type(weight) in (Tensor, torch.nn.Parameter):
        if weight.dtype != torch.bfloat16:
            return f"plain {weight.dtype} weight (the kernel reads bfloat16, int8 or fp8 weights)"
        if not weight.is_contiguous():
            return "bfloat16 weight is not contiguous"
        return WeightParts("bf16", weight.detach(), None)
    names, ctx = flatten()
    inner = {n: getattr(weight, n) for n in names}
    if set(inner) - {"qdata", "scale", "zero_point"} or not {"qdata", "scale"} <= set(inner):
        return f"{type(weight).__name__} flattens to {sorted(inner)}, not qdata and scale"
    if isinstance(ctx, dict) and ctx.get("act_quant_kwargs") is not None:
        return f"{type(weight).__name__} quantizes the activations too (not weight-only)"
    q, s = inner["qdata"], inner["scale"]
    kind = _KIND_OF_DTYPE.get(q.dtype)
    if kind not in ("int8", "fp8") or type(q) is not Tensor or type(s) is not Tensor:
        return f"qdata of dtype {q.dtype} ({type(q).__name__}): the kernel reads int8 or float8_e4m3fn"
    out = weight.shape[0]
    if tuple(q.shape) != tuple(weight.shape) or not q.is_contiguous():
        return f"qdata has shape {tuple(q.shape)} (contiguous: {q.is_contiguous()}), weight {tuple(weight.shape)}"
    if s.dtype not in _SCALE_DTYPES or s.numel() not in (out, 1) or not s.is_contiguous():
        return f"scale of shape {tuple(s.shape)} and dtype {s.dtype}: not one per output row"
    zp = inner.get("zero_point")
    if check_values and zp is not None and bool(zp.any()):
        return "zero_point is not all zeros (asymmetric quantization)"
    return WeightParts(kind, q, s)


class NativeLinear:
    """A linear layer the kernel runs: ``self(x)`` is its forward for ``x`` of up to
    ``max_rows`` rows (``applies(x)``). The weight is read from the module at each call (a
    streamed block's parameters move between calls), by the inner tensors' names found when the
    layer was accepted; a weight of another type is examined again."""

    __slots__ = ("module", "kind", "max_rows", "_wtype")

    def __init__(self, module: torch.nn.Linear, kind: Kind, max_rows: int = MAX_ROWS) -> None:
        self.module = module
        self.kind: Kind = kind
        self.max_rows = max_rows
        self._wtype = type(module.weight)

    def __repr__(self) -> str:
        return f"NativeLinear({type(self.module).__name__}, kind={self.kind!r}, max_rows={self.max_rows})"

    def applies(self, x: Tensor) -> bool:
        """Whether ``x`` is for the kernel: float32 or bfloat16 on the CPU, at most ``max_rows``
        rows, no gradient wanted."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        return (
            x.dtype in _ACT_DTYPES
            and x.device.type == "cpu"
            and 0 < rows <= self.max_rows
            and not (torch.is_grad_enabled() and (x.requires_grad or self.module.weight.requires_grad))
        )

    def __call__(self, x: Tensor) -> Tensor:
        w = self.module.weight
        if type(w) is not self._wtype:
            parts = weight_parts(w)
            if isinstance(parts, str):
                raise ValueError(f"weight: {parts}")
            self.kind, self._wtype = parts.kind, type(w)
        # Attribute reads only: a wrapper subclass's methods go through its __torch_function__
        # (tens of microseconds a call at decode); the kernel checks what it reads.
        data, scale = (w, None) if self.kind == "bf16" else (getattr(w, "qdata"), getattr(w, "scale"))
        bias = self.module.bias
        return linear(x, data, scale, bias, self.kind)


def native_linear(module: torch.nn.Module, max_rows: int = MAX_ROWS) -> NativeLinear | None:
    """The native forward of ``module`` (an ``nn.Linear``: a ``weight`` ``[out, in]`` and a
    ``bias`` or None) if the kernel reads its weight, else None (``weight_parts`` says why)."""
    if not isinstance(module, torch.nn.Linear):
        return None
    parts = weight_parts(module.weight)
    if isinstance(parts, str):
        return None
    bias = module.bias
    if bias is not None and (bias.dtype not in _ACT_DTYPES or bias.device.type != "cpu" or not bias.is_contiguous()):
        return None
    return NativeLinear(module, parts.kind, max_rows)
