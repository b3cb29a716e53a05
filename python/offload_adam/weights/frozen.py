"""Frozen quantized weights in training (QLoRA-style): the base is streamed in the backward too.

A linear layer over a frozen quantized weight (a wrapper subclass: torchao's) saves for its
backward what the subclass's own ``F.linear`` saves: a dequantized copy of the weight, held until
the backward, for every layer: the whole base in full precision on the device. While a streamed
block with such weights runs a forward that builds a graph, :class:`FrozenLinearMode` routes
``F.linear`` of a frozen wrapped weight, an input that wants a gradient and no bias that does
through :class:`FrozenLinear`: it saves the parameter itself (the streamer packs it as a token,
and loads the block again when the backward unpacks it) and the input, and its backward runs
the subclass's own ``F.linear`` again on them under autograd for the input's gradient: the same
operations as the layer resident, so the same bits, for one more matmul per layer. The weight
gets no gradient.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


class FrozenLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward gives ``x`` its gradient only, from the
    weight saved as itself (see the module documentation)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias = bias  # (no gradient wanted: not saved for one)
        # The forward's autocast state, for the backward's recompute (a custom Function's
        # backward runs with the backward thread's, normally off: an fp32 GEMM over an fp32
        # dequantized copy where the layer resident ran bf16; CUDA review, second pass, hazard 5).
        kind = x.device.type
        # Any device type with autocast (not only "cuda" and "cpu": a backend of its own too).
        ctx.amp = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) if torch.amp.is_autocast_available(kind) else None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        x, weight = ctx.saved_tensors
        amp = ctx.amp
        autocast = torch.autocast(amp[0], dtype=amp[2], enabled=amp[1]) if amp is not None else contextlib.nullcontext()
        with torch.enable_grad(), autocast:
            xd = x.detach().requires_grad_(True)
            y = F.linear(xd, weight, ctx.bias)
        (gx,) = torch.autograd.grad(y, xd, grad)
        return gx, None, None


class FrozenLinearMode(TorchFunctionMode):
    """Routes ``F.linear`` over the frozen wrapped parameters ``params`` (by ``id``) through
    :class:`FrozenLinear` when the input wants a gradient."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                id(w) in self.params
                and isinstance(x, Tensor)
                and x.requires_grad
                and not w.requires_grad
                and (b is None or not b.requires_grad)
            ):
                return FrozenLinear.apply(x, w, b)
        return func(*args, **kwargs)
