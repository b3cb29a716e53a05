"""Training through routed experts stored per expert (issue 34, point 6): a frozen base whose
routed experts stay on the host, adapters (LoRA on the attention, the shared experts) trained.

A forward that builds a graph through an offloaded experts module (gradients enabled and the
hidden states or the routing weights wanting one) runs :func:`train_forward` instead of the
inference path of ``experts.py``: transformers' ``"eager"`` loop, op for op, on the device the
hidden states are on (the routing mask, each expert's rows gathered, the routing weight, the
``index_add_``), where each expert's own computation (gate/up projection, gate, down projection,
the post-expert norm) is one :class:`RoutedExpert`, run on the host from its unit. The autograd
graph is so the resident eager model's, node for node in the same order, with one node per
routed expert in place of its projections: the backward accumulates the hidden states' gradient
in the same order (each expert's contribution apart, then the shared experts' and the router's
as the resident model's engine adds them), and so gives the same bits.

:class:`RoutedExpert` computes no gradient of a weight (the experts are frozen: a parameter of
them that wants a gradient is refused, see :func:`check_frozen`) and saves nothing of the
experts' weights: its backward takes the unit from the store again (``storage="cpu"``: the host
copy; ``"nvme"``: the RAM cache, read again on a miss) and recomputes the expert's forward
under autograd on the host for the input's gradient (one more gate/up and down projection per
routed expert and step, as ``frozen.py`` recomputes a frozen quantized linear). What a step keeps
for the backward, per routed expert of each experts call: its rows of the hidden states, on the
host (``rows x hidden``, in the model's dtype: ``tokens x top_k x hidden`` a layer); and, on the
hidden states' device, what the eager loop keeps around the expert (its output rows for the
routing weight's gradient, the routing weight, the indices). The gradients cross as the hidden
states did: a device's to the host (the d2h stream after the compute stream) and back (the h2d
stream after the allocation), per routed expert.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .experts import Experts
    from .expertstore import ExpertsLayout


def builds_graph(lay: ExpertsLayout, hidden: Tensor, weights: Tensor) -> bool:
    """Whether an experts call builds an autograd graph (then :func:`train_forward` runs it); a
    routed experts parameter that wants a gradient is refused first (:func:`check_frozen`)."""
    if not torch.is_grad_enabled():
        return False
    check_frozen(lay)
    return hidden.requires_grad or weights.requires_grad


def check_frozen(lay: ExpertsLayout) -> None:
    """A ValueError naming a routed experts parameter that wants a gradient, in a forward with
    gradients enabled: the resident model would give it one, and its units cannot (they are
    frozen: the optimizer would silently step nothing for it)."""
    for ep in lay.params:
        if ep.param.requires_grad:
            raise ValueError(
                f"model: {lay.name}.{ep.name} requires a gradient, but routed experts stored per expert are frozen (the "
                "backward gives the hidden states their gradient, never the experts' weights): freeze it with "
                "requires_grad_(False) (peft's get_peft_model does), or run inference under torch.no_grad()"
            )


def check_unwrapped(model: torch.nn.Module, m: torch.nn.Module, where: str) -> None:
    """A ValueError naming the module that holds the experts module ``m`` as its ``base_layer``:
    peft's ``ParamWrapper`` (LoRA on the routed experts' parameters, ``target_parameters=``, or a
    ``target_modules`` list naming ``gate_proj``/``up_proj``/``down_proj``, which peft 0.21 maps to
    them on a transformers 5 MoE model) adds its delta to the fused parameter at each call, a
    parameter stored per expert is a meta placeholder meanwhile; the experts are frozen here."""
    for name, outer in model.named_modules():
        if outer is not m and getattr(outer, "base_layer", None) is m:
            raise ValueError(
                f"model: {name or '<model>'} ({type(outer).__name__}) wraps the routed experts {where}: an adapter on "
                "the routed experts' parameters (peft's target_parameters=, or target_modules naming gate_proj/up_proj/"
                "down_proj on a transformers 5 MoE model) cannot be offloaded per expert, whose experts are frozen; put "
                "the adapters on the attention or the shared experts"
            )


def _expert(m: Any, w: dict[str, Tensor], x: Tensor) -> Tensor:
    """One expert's computation in the eager loop's operations (``experts.expert_out``)."""
    from .experts import expert_out  # (experts imports this module)

    return expert_out(m, w, x)


def _amp() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")


class RoutedExpert(torch.autograd.Function):
    """Expert ``e`` of ``lay`` over its rows ``x`` (on any device), run on the host from its
    unit; its backward gives ``x`` its gradient only (module documentation)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, unit: Tensor, owner: Experts, m: Any, lay: ExpertsLayout, e: int, first: bool) -> Tensor:  # type: ignore[override]
        from .experts import _enter_modes, _leave_modes

        xh = x if x.device.type == "cpu" else owner._to_host(x)
        mode = _leave_modes()  # (torch's kernels, as the eager loop's: a NativeMatmul around a CPU block must not take them)
        try:
            y = _expert(m, lay.weights(unit), xh)
        finally:
            _enter_modes(mode)
        ctx.save_for_backward(xh)
        ctx.owner, ctx.m, ctx.lay, ctx.e, ctx.amp, ctx.first = owner, m, lay, e, _amp(), first
        return y if x.device.type == "cpu" else owner._to_device(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None, None]:
        from .experts import _enter_modes, _leave_modes

        (xh,) = ctx.saved_tensors
        owner, lay = ctx.owner, ctx.lay
        on_host = grad.device.type == "cpu"
        gh = grad if on_host else owner._to_host(grad)
        enabled, dtype = ctx.amp
        st = owner.stats["backward"]
        s = owner.store
        hits, misses, read, t0 = s.hits, s.misses, s.stats.read_bytes, time.perf_counter()
        mode = _leave_modes()
        try:
            autocast = torch.autocast("cpu", dtype=dtype) if enabled else contextlib.nullcontext()
            for _, unit in s.units(lay, [ctx.e]):  # (valid in this body only: the gradient taken here)
                with torch.enable_grad(), autocast:
                    xd = xh.detach().requires_grad_(True)
                    y = _expert(ctx.m, lay.weights(unit), xd)
                (gx,) = torch.autograd.grad(y, xd, gh)
        finally:
            _enter_modes(mode)
            st["experts"] += 1
            st["calls"] += ctx.first  # (one experts call's backward: its last expert's runs first)
            st["hits"] += s.hits - hits
            st["misses"] += s.misses - misses
            st["read_bytes"] += s.stats.read_bytes - read
            st["cpu_s"] += time.perf_counter() - t0
        return (gx if on_host else owner._to_device(gx)), None, None, None, None, None, None


def train_forward(owner: Experts, m: Any, lay: ExpertsLayout, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' eager loop with each expert a :class:`RoutedExpert` (module documentation),
    on the hidden states' device."""
    st = owner.stats[owner.phase]
    st["calls"] += 1
    st["torch"] += 1
    s = owner.store
    hits, misses, read, t0 = s.hits, s.misses, s.stats.read_bytes, time.perf_counter()
    try:
        return _loop(owner, m, lay, hidden_states, top_k_index, top_k_weights)
    finally:
        st["hits"] += s.hits - hits
        st["misses"] += s.misses - misses
        st["experts"] += s.hits - hits + s.misses - misses
        st["read_bytes"] += s.stats.read_bytes - read
        st["cpu_s"] += time.perf_counter() - t0


def _loop(owner: Experts, m: Any, lay: ExpertsLayout, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    from .experts import _routing  # (experts imports this module)

    n = lay.experts
    final_hidden_states = torch.zeros_like(hidden_states)
    expert_mask, expert_hit = _routing(top_k_index, n)
    if expert_hit.device.type != "cpu":  # (which experts: read on the host, as the eager loop's iteration syncs)
        expert_hit = owner._to_host(expert_hit)
    hit = [int(i) for i in expert_hit[:, 0].tolist() if i < n]
    for e, unit in owner.store.units(lay, hit):
        top_k_pos, token_idx = torch.where(expert_mask[e])
        current_state = hidden_states[token_idx]
        h = RoutedExpert.apply(current_state, unit, owner, m, lay, e, e == hit[-1])
        h = h * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
    return final_hidden_states


__all__ = ["RoutedExpert", "builds_graph", "check_frozen", "check_unwrapped", "train_forward"]
