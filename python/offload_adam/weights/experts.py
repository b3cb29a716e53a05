"""Routed experts offloaded with the expert as the unit, through transformers' own experts
interface (issue 34).

Every mixture-of-experts model transformers 5 ships keeps its routed experts in a module whose
class is decorated with ``transformers.integrations.moe.use_experts_implementation``: fused 3D
parameters (``gate_up_proj`` ``[E, 2I, H]`` or ``up_proj``, ``down_proj`` ``[E, H, I]``, their
biases with ``has_bias``), layout flags on the instance (``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``) and a forward looked up per call
in ``ALL_EXPERTS_FUNCTIONS`` by ``self.config._experts_implementation``. :func:`find_experts` finds
such modules (by those attributes, never by class); their fused parameters leave the layer's
block (the layer's attention, norms, router and shared experts are stored, streamed and placed
as before) and are stored per expert (``expertstore.py``).

``offload_weights`` registers :func:`experts_forward` under :data:`NAME` and sets each experts
module's config to it (the config's own attribute: no model code is patched, and
``model.set_experts_implementation``, which only a ``PreTrainedModel`` has, is not needed);
``close()`` sets back what each config said. Given the router's ``top_k_index`` and
``top_k_weights``, the function reads only the routed experts' units, where they live, and
computes them on the host:

- with torch's kernels (``native_matmul=False``, a prompt of more than ``hostmatmul.MAX_ROWS``
  rows, a gradient wanted, a layout the native path does not take): transformers' ``"eager"``
  loop, the same operations in the same order (experts in ascending order, each one's rows
  gathered, ``F.linear`` or ``@`` by ``is_transposed``, the module's own ``_apply_gate`` or
  ``act_fn``, the post-expert norm, the routing weight, ``index_add_``), so that the result is
  bitwise that of the resident model run with ``experts_implementation="eager"``;
- with the native kernel (bfloat16, torchao's int8 and fp8 weight-only experts, a decode step,
  the default gated SiLU layout): :func:`run_native`, one call of the routed-experts kernel
  (``_native.experts``) for a layer's routed experts where their units all live in RAM, one per
  expert as they are read from the SSD.

A module called on a device (the layer streamed to a GPU) runs its experts from the device's
expert cache (:class:`DeviceCache`, ``gpu_budget_gb``'s remainder, issue 34's point 4: a miss copied
or, by the cost model, computed on the host for its rows), or without one sends its hidden states
to the host and gets the sum back. A module whose config is switched but which this
offload does not hold (a second model sharing the config) runs the implementation its config
named before.

Models whose experts are a ``ModuleList`` of MLPs (``nn.Linear`` each) are left to the block
machinery: their experts stream with their layer, as every layer's weights do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _native
from ..runtime.device import Device
from .costs import CostModel
from .expertgrad import builds_graph, check_unwrapped, train_forward
from .expertstore import ExpertParam, ExpertsLayout, ExpertStore, _Slru, expert_param
from .hostmatmul import MAX_ROWS, NativeMatmul, best_times, weight_parts
from .placement import call_shape, to_device, to_host

NAME = "offload_adam"  # the name of the offload's function in transformers' ExpertsInterface
ATTR = "_offload_adam_experts"  # an experts module's runner, while offloaded
STREAM_ROWS = 32  # a call on the device of more rows (a prompt) streams its routed experts whole (Experts._streamed)
FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
# Whether the experts kernel's tasks run on torch's own OpenMP team (``_native.experts(...,
# omp=True)``, as ``hostmatmul.LINEAR_OMP`` for the linear kernel) instead of the kernel's rayon
# pool, where the process has the team. The same bits either way. Inside a model the pool's
# threads and torch's spinning OpenMP workers fight over the cores between a layer's operations:
# on the quiet Zen 4 VM ``bench --moe``'s model decoded 1.44x faster on the team (one process,
# 6 interleaved rounds of 32 tokens, 30.9 against 21.3 tokens/s; docs/benchmarks.md).
EXPERTS_OMP = _native.omp_available()


def is_fused_experts(m: torch.nn.Module) -> bool:
    """Whether ``m`` is an experts module of transformers' experts interface: the decorator's
    layout flags and config on the instance, ``num_experts`` and ``down_proj`` of ``num_experts``
    experts."""
    config = getattr(m, "config", None)
    if config is None or not hasattr(config, "_experts_implementation") or not all(hasattr(m, f) for f in FLAGS):
        return False
    n = getattr(m, "num_experts", None)
    down = m._parameters.get("down_proj")
    return isinstance(n, int) and down is not None and down.dim() >= 2 and down.shape[0] == n


def find_experts(model: torch.nn.Module, keep: frozenset[int] = frozenset(), checkpoint: bool = False) -> list[ExpertsLayout]:
    """The fused experts modules of ``model`` (see the module documentation) with their fused
    parameters (every parameter of the module whose first dimension is ``num_experts``), laid out
    as units. Raises naming the module where one cannot be offloaded per expert. ``checkpoint``:
    a checkpoint fills the units (a parameter may be on the meta device)."""
    out: list[ExpertsLayout] = []
    seen: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in seen or not is_fused_experts(m):
            continue
        seen.add(id(m))
        where = name or "<model>"
        if getattr(m, "_is_expert_parallel", False):
            raise ValueError(f"model: {where} is an expert-parallel experts module (its experts are split over ranks): not offloaded per expert")
        e = int(m.num_experts)
        params: list[ExpertParam] = []
        for pname, p in m._parameters.items():
            if p is None or p.dim() < 2 or p.shape[0] != e:
                continue
            if id(p) in keep:
                raise ValueError(f"resident: {where}.{pname} is a routed experts parameter, offloaded per expert; leave it out of resident=")
            if p.device.type == "meta" and not checkpoint:
                raise ValueError(f"model: {where}.{pname} is on the meta device: pass checkpoint= to load the weights")
            params.append(expert_param(where, pname, p, e))
        check_unwrapped(model, m, where)  # (an adapter on the experts' parameters: expertgrad.py)
        lay = ExpertsLayout(len(out), where, m, e, params)
        lay.layout()
        out.append(lay)
    return out


def expert_params(layouts: list[ExpertsLayout]) -> frozenset[int]:
    """The fused parameters of ``layouts`` (by ``id``): in no block."""
    return frozenset(id(ep.param) for lay in layouts for ep in lay.params)


def _is_silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


@dataclass
class Decided:
    """What the calls of one experts module need, decided once when the offload attaches
    (:func:`decide`): whether its layout is one the native kernel takes, and where its units'
    weights live in RAM (``storage="cpu"``), the kernel's views of every expert's, so that a
    decode call is the routing and one kernel call."""

    native: bool  # gated SiLU, concatenated, not transposed, no bias or post-expert norm, bf16/int8/fp8
    quantized: bool  # torchao's int8 or fp8 weight-only experts (else bfloat16)
    gate_up: list[Tensor] | None = None  # per expert (RAM units only): the kernel's gate_up data
    down: list[Tensor] | None = None
    gate_up_scale: list[Tensor] | None = None  # quantized: per expert, flat
    down_scale: list[Tensor] | None = None


def decide(m: Any, lay: ExpertsLayout, ram: Tensor | None, offset: int, stride: int) -> Decided:
    """:class:`Decided` for module ``m`` stored as ``lay``; ``ram``: the store's host copy of
    every unit (``lay``'s first at ``offset``, ``stride`` bytes apart), None from the SSD."""
    from transformers.integrations.moe import _default_apply_gate

    native = (
        m.has_gate and not m.has_bias and not m.is_transposed and m.is_concatenated
        and not getattr(m, "has_post_expert_norm", False)
        and getattr(type(m), "_apply_gate", None) is _default_apply_gate and _is_silu(getattr(m, "act_fn", None))
        and sorted(ep.name for ep in lay.params) == ["down_proj", "gate_up_proj"]
    )  # fmt: skip
    quantized = lay.params[0].kind is not None
    if not quantized and any(q.dtype is not torch.bfloat16 for ep in lay.params for q in ep.parts):
        native = False
    d = Decided(native, quantized)
    if not native or ram is None:
        return d
    views: dict[str, tuple[list[Tensor], list[Tensor]]] = {"gate_up_proj": ([], []), "down_proj": ([], [])}
    for e in range(lay.experts):
        w = lay.weights(ram[offset + e * stride : offset + e * stride + lay.unit_bytes])
        for name, (data, scales) in views.items():
            parts = weight_parts(w[name])
            if isinstance(parts, str):  # (a quantized layout the kernel does not read: torch's loop)
                return Decided(False, quantized)
            data.append(parts.data)
            if parts.scale is not None:
                scales.append(parts.scale.reshape(-1))
    d.gate_up, d.down = views["gate_up_proj"][0], views["down_proj"][0]
    if quantized:
        d.gate_up_scale, d.down_scale = views["gate_up_proj"][1], views["down_proj"][1]
    return d


def native_experts_faster(threads: int, hidden: int, inter: int, k: int, rounds: int = 3) -> bool:
    """Whether the native kernel's one call of ``k`` bfloat16 experts (``gate_up`` ``[2 inter,
    hidden]``, ``down`` ``[hidden, inter]``) on one row beats torch's per-expert loop (the eager
    loop's operations) on this machine with ``threads`` threads, the weights read from DRAM as at
    decode: the calls cycle over distinct experts of at least 192 MB in all (well over a
    server's L3), best of ``rounds`` passes each; measured once per process and shape. The
    kernel's 1-row matmul of one weight that stays in cache (``hostmatmul.bf16_faster``) does not
    say it: on this project's Zen 4 VM torch's led there while the kernel's experts call led the
    loop by 1.1-1.2x."""
    key = (threads, hidden, inter, k)
    known = _EXPERTS_FASTER.get(key)
    if known is not None:
        return known
    g = torch.Generator().manual_seed(0)
    gu0 = (torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5).to(torch.bfloat16)
    dn0 = (torch.randn(hidden, inter, generator=g) * inter**-0.5).to(torch.bfloat16)
    per = (gu0.numel() + dn0.numel()) * 2
    n = max(k, min(8 * k, -(-(192 << 20) // per)))
    gu = [gu0.clone() for _ in range(n)]
    dn = [dn0.clone() for _ in range(n)]
    x = torch.randn(1, hidden, generator=g).to(torch.bfloat16)
    w = torch.softmax(torch.randn(1, k, generator=g), -1)
    wb = w.to(torch.bfloat16)
    out = torch.empty_like(x)
    local = torch.arange(k).view(1, k)
    groups = [list(range(i, i + k)) for i in range(0, n - k + 1, k)]

    def kernel() -> None:
        for grp in groups:
            _native.experts(x, [gu[e] for e in grp], [dn[e] for e in grp], local, wb, out=out, num_threads=threads, omp=EXPERTS_OMP)

    def loop() -> None:
        for grp in groups:
            acc = torch.zeros_like(x)
            for j, e in enumerate(grp):
                a, b = F.linear(x, gu[e]).chunk(2, dim=-1)
                acc.index_add_(0, local[0, :1], F.linear(F.silu(a) * b, dn[e]) * wb[:, j, None])

    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ours, theirs = best_times(kernel, loop, rounds)
    finally:
        torch.set_num_threads(prev)
    _EXPERTS_FASTER[key] = ours < theirs
    return ours < theirs


_EXPERTS_FASTER: dict[tuple[int, int, int, int], bool] = {}


def run_native(
    x: Tensor, gate_up: list[Tensor], down: list[Tensor], index: Tensor, weights: Tensor, *,
    gate_up_scale: list[Tensor | None] | None = None, down_scale: list[Tensor | None] | None = None,
    out: Tensor, act: str = "silu", num_threads: int = 1, omp: bool | None = None,
) -> None:  # fmt: skip
    """``out[r] = sum_k weights[r, k] * down[u] @ (silu(g) * u)`` with ``g; u = gate_up[u] @ x[r]``,
    ``u = index[r, k]`` (``-1``: skipped), in one call of the routed-experts kernel
    (``_native.experts``: the intermediate in float32, rounded once; its bound in
    ``rust/linear/experts.rs``). ``x`` ``[rows, H]``, ``gate_up[u]`` ``[2I, H]`` (gate;up),
    ``down[u]`` ``[H, I]``, bfloat16, or int8/float8_e4m3fn with their per-row scales."""
    gs = [t.reshape(-1) for t in gate_up_scale] if gate_up_scale else None  # type: ignore[union-attr]
    ds = [t.reshape(-1) for t in down_scale] if down_scale else None  # type: ignore[union-attr]
    _native.experts(
        x, gate_up, down, index, weights.to(x.dtype).contiguous(), gate_up_scale=gs, down_scale=ds, out=out, act=act,
        num_threads=num_threads, omp=EXPERTS_OMP if omp is None else omp,
    )  # fmt: skip


class Experts:
    """The offload's routed experts: their store, the switch of their modules to
    :func:`experts_forward` and back, and what they did (``report()``)."""

    def __init__(
        self, device: Device, layouts: list[ExpertsLayout], store: ExpertStore, native_matmul: bool | None,
        num_threads: int | None, gpu: DeviceCache | None = None, cost_model: CostModel | None = None,
    ) -> None:  # fmt: skip
        self.device = device
        self.gpu = gpu
        self.cost_model = cost_model
        self.layouts = layouts
        self.store = store
        self.native_matmul = native_matmul
        self.num_threads = num_threads
        self.bf16: bool | None = None  # whether bf16 experts go to the native kernel (decided at the first call)
        self.decided: dict[int, Decided] = {}  # by layout index: decided once, at attach (decide)
        self.saved: list[tuple[Any, Any]] = []  # (config, its experts implementation before)
        self.handles: list[Any] = []
        self.phase = "prompt"
        self.stream_bufs: list[Tensor] = []  # the two device buffers a call of many rows streams its experts through
        self.stream_free: list[Any] = [None, None]  # each buffer's last reader (an event of the compute stream)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.store.reset_stats()
        z = {
            "calls": 0, "experts": 0, "hits": 0, "misses": 0, "read_bytes": 0, "native": 0, "torch": 0, "cpu_s": 0.0,
            "gpu_hits": 0, "copied": 0, "cpu_computed": 0, "h2d_bytes": 0, "streamed": 0,
        }  # fmt: skip
        self.stats: dict[str, dict[str, Any]] = {"prompt": dict(z), "decode": dict(z), "backward": dict(z)}

    def report(self) -> dict[str, Any]:
        s = self.store
        return {
            "expert_modules": len(self.layouts),
            "expert_units": sum(lay.experts for lay in self.layouts),
            "expert_bytes": sum(lay.nbytes for lay in self.layouts),
            "expert_ram_bytes": s.ram_bytes,
            "expert_cache_units": s.capacity,
            "expert_nvme_bytes": s.nvme_bytes,
            "expert_gpu_units": self.gpu.capacity if self.gpu is not None else 0,
            "expert_gpu_bytes": self.gpu.nbytes if self.gpu is not None else 0,
            "experts": {ph: dict(v) for ph, v in self.stats.items()},
        }

    # -- the switch -----------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module) -> None:
        """Each experts module's config to :data:`NAME` (the previous name kept), its runner set;
        a hook on its parent (the sparse MoE block, whose call tells prompt from decode)."""
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS[NAME] = experts_forward
        s = self.store
        for lay in self.layouts:
            m = lay.module
            self.decided[lay.index] = decide(m, lay, s.buf, s.offset[lay.index], s.stride[lay.index])
            setattr(m, ATTR, (self, lay))
            cfg: Any = m.config
            if not any(c is cfg for c, _ in self.saved):
                self.saved.append((cfg, cfg._experts_implementation))
                _PREVIOUS[id(cfg)] = cfg._experts_implementation
                cfg._experts_implementation_internal = NAME
            parent = _parent_of(model, m)
            if parent is not None:
                self.handles.append(parent.register_forward_pre_hook(self._phase, with_kwargs=True))

    def detach(self) -> None:
        """The configs and modules back as they were."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for cfg, before in self.saved:
            cfg._experts_implementation_internal = before
            _PREVIOUS.pop(id(cfg), None)
        self.saved = []
        self.decided = {}  # (its views hold the store's host copy)
        for lay in self.layouts:
            lay.module.__dict__.pop(ATTR, None)

    def _phase(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        _, seq = call_shape(args, kwargs)
        self.phase = "prompt" if seq > 1 else "decode"

    # -- a call -----------------------------------------------------------------------------------

    def _native_ok(self, lay: ExpertsLayout, x: Tensor) -> bool:
        """Whether this call runs :func:`run_native` (see the module documentation): the layout's
        verdict (decided at attach), then what only the call says."""
        d = self.decided[lay.index]
        if not d.native or self.native_matmul is False or x.dtype not in (torch.bfloat16, torch.float32):
            return False
        if not 0 < x.shape[0] <= MAX_ROWS or torch.is_grad_enabled() and x.requires_grad or torch.is_autocast_enabled("cpu"):
            return False
        if d.quantized:
            return True
        if x.dtype is not torch.bfloat16:
            return False
        if self.native_matmul is None:
            if self.bf16 is None:
                ep = {e.name: e for e in lay.params}
                inter, hidden = ep["down_proj"].shape[1], ep["down_proj"].shape[0]
                self.bf16 = native_experts_faster(self.num_threads or torch.get_num_threads(), hidden, inter, self._top_k(lay))
            return self.bf16
        return True

    @staticmethod
    def _top_k(lay: ExpertsLayout) -> int:
        """The routed experts per token of ``lay``'s model (8 when its config does not say)."""
        cfg = lay.module.config
        for key in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k"):
            v = getattr(cfg, key, None)
            if isinstance(v, int) and v > 0:
                return min(v, lay.experts)
        return min(8, lay.experts)

    def forward(self, m: torch.nn.Module, lay: ExpertsLayout, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        if builds_graph(lay, hidden, weights):  # (training: expertgrad.py)
            return train_forward(self, m, lay, hidden, index, weights)
        on_host = hidden.device.type == "cpu"
        if not on_host:
            if self.gpu is None:
                hidden, index, weights = (self._to_host(t) for t in (hidden, index, weights))
        t0 = time.perf_counter()
        st = self.stats[self.phase]
        st["calls"] += 1
        s = self.store
        hits, misses, read = s.hits, s.misses, s.stats.read_bytes
        mode = _leave_modes()  # (our own kernels here: a NativeMatmul around the block must not take them)
        try:
            if not on_host and self.gpu is not None:
                st["torch"] += 1
                if hidden.shape[0] > STREAM_ROWS:
                    return self._streamed(m, lay, hidden, index, weights)
                return self._on_device(m, lay, hidden, index, weights)
            if self._native_ok(lay, hidden):
                st["native"] += 1
                out = self._native(lay, hidden, index, weights)
            else:
                st["torch"] += 1
                out = self._eager(m, lay, hidden, index, weights)
        finally:
            _enter_modes(mode)
            st["hits"] += s.hits - hits
            st["misses"] += s.misses - misses
            st["experts"] += s.hits - hits + s.misses - misses
            st["read_bytes"] += s.stats.read_bytes - read
            st["cpu_s"] += time.perf_counter() - t0
        return out if on_host else self._to_device(out)

    def _eager(self, m: Any, lay: ExpertsLayout, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """transformers' ``"eager"`` loop over the units (see the module documentation)."""
        n = lay.experts
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask, expert_hit = _routing(top_k_index, n)
        hit = [int(i) for i in expert_hit[:, 0].tolist() if i < n]
        keep = torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad) and self.store.nvme
        gate = "gate_up_proj" if m.has_gate else "up_proj"
        for e, unit in self.store.units(lay, hit):
            w = lay.weights(unit)
            if keep:  # (a backward reads them after the slot is reused)
                w = {k: v.clone() for k, v in w.items()}
            top_k_pos, token_idx = torch.where(expert_mask[e])
            h = _expert(m, w, hidden_states[token_idx], top_k_weights[token_idx, top_k_pos, None])
            final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
        return final_hidden_states

    def _on_device(self, m: Any, lay: ExpertsLayout, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The eager loop on the device (issue 34, point 4): an expert in the device cache runs
        there; a miss is copied into it (its unit's bytes only) or computed on the host (its rows
        across and back), as the cost model prices the expert's bytes against its rows (without
        one: copied). The same operations, summed on the device in ascending expert order."""
        gpu = self.gpu
        assert gpu is not None
        st = self.stats[self.phase]
        n = lay.experts
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask, expert_hit = _routing(top_k_index, n)
        hit = [int(i) for i in self._to_host(expert_hit[:, 0]).tolist() if i < n]  # (the one sync of a call)
        dtype = lay.params[0].parts[0].dtype
        params = sum(q.numel for ep in lay.params for q in ep.parts)
        for e in hit:
            top_k_pos, token_idx = torch.where(expert_mask[e])
            unit = gpu.get(lay.index, e)
            if unit is not None:
                st["gpu_hits"] += 1
                st["experts"] += 1
            else:
                rows = int(token_idx.shape[0])
                where = self.cost_model.choose(lay.unit_bytes, params, rows, dtype) if self.cost_model is not None else "stream"
                for _, host_unit in self.store.units(lay, [e]):
                    if where == "stream":
                        unit = gpu.put(lay.index, e, host_unit)
                        st["copied"] += 1
                        st["h2d_bytes"] += lay.unit_bytes
                    else:
                        x = self._to_host(hidden_states[token_idx])
                        wk = self._to_host(top_k_weights[token_idx, top_k_pos, None])
                        h = self._to_device(_expert(m, lay.weights(host_unit), x, wk))
                        st["cpu_computed"] += 1
            if unit is not None:
                h = _expert(m, lay.weights(unit), hidden_states[token_idx], top_k_weights[token_idx, top_k_pos, None])
            final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
        return final_hidden_states

    def _streamed(self, m: Any, lay: ExpertsLayout, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """A call of more than :data:`STREAM_ROWS` rows on the device (a prompt): every routed
        expert runs there, the eager loop's operations in its order; those the device cache holds
        from it, the others' units streamed whole through two device buffers on the copy stream,
        the next copied while the current computes (the cache left as it was: a prompt's experts
        would evict the decode's). Waits (ARCHITECTURE.md): a copy into a buffer after the compute
        that read it last (its event, kept across calls); the compute after its copy (a stream
        wait); a unit from the SSD's RAM cache, the host after its copy (the store reuses the
        slot for the next unit)."""
        gpu = self.gpu
        assert gpu is not None
        dev = self.device
        st = self.stats[self.phase]
        n = lay.experts
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask, expert_hit = _routing(top_k_index, n)
        hit = [int(i) for i in self._to_host(expert_hit[:, 0]).tolist() if i < n]  # (the one sync of a call)
        cached = {e: gpu.get(lay.index, e) for e in hit}
        miss = [e for e in hit if cached[e] is None]
        if miss and not self.stream_bufs:
            self.stream_bufs = [dev.empty(gpu.slot_bytes, torch.uint8) for _ in range(2)]
            self.stream_free = [dev.record_current(), dev.record_current()]  # (after the allocation)
        bufs, free = self.stream_bufs, self.stream_free
        units = self.store.units(lay, miss)
        copied: dict[int, tuple[int, Any]] = {}

        def issue(i: int) -> None:
            e, host_unit = next(units)
            b = i % 2
            dev.stream_waits(dev.h2d, free[b])  # after the compute that read the buffer last
            dev.copy([(bufs[b][: host_unit.numel()], host_unit)], dev.h2d)
            done = dev.record(dev.h2d)
            if self.store.buf is None:
                dev.host_wait(done)  # (the store's slot is reused for the next unit)
            copied[e] = (b, done)
            st["streamed"] += 1
            st["h2d_bytes"] += lay.unit_bytes

        try:
            if miss:
                issue(0)
            k = 0
            for e in hit:
                top_k_pos, token_idx = torch.where(expert_mask[e])
                unit = cached[e]
                if unit is not None:
                    st["gpu_hits"] += 1
                    st["experts"] += 1
                    h = _expert(m, lay.weights(unit), hidden_states[token_idx], top_k_weights[token_idx, top_k_pos, None])
                    final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
                    continue
                if k + 1 < len(miss):
                    issue(k + 1)
                b, done = copied.pop(e)
                dev.current_waits(done)  # the compute after its copy
                h = _expert(m, lay.weights(bufs[b]), hidden_states[token_idx], top_k_weights[token_idx, top_k_pos, None])
                final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
                free[b] = dev.record_current()
                k += 1
        finally:
            units.close()
        return final_hidden_states

    def _native(self, lay: ExpertsLayout, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """The routed experts on :func:`run_native`: in one call where every unit lives in RAM
        (the kernel's views of them made at attach), else each as it is read, their results
        summed in float32 and rounded once."""
        n = lay.experts
        rows = index.tolist()
        routed = sorted({i for r in rows for i in r if 0 <= i < n})
        threads = self.num_threads or torch.get_num_threads()
        x = x.contiguous()
        out = torch.empty_like(x)
        d = self.decided[lay.index]
        if d.gate_up is not None and d.down is not None:
            self.store.hits += len(routed)
            if any(i >= n for r in rows for i in r):  # (an expert-parallel rank's foreign experts: n)
                index = torch.tensor([[i if i < n else -1 for i in r] for r in rows], dtype=torch.int64)
            run_native(
                x, d.gate_up, d.down, index.to(torch.int64).contiguous(), weights, gate_up_scale=d.gate_up_scale,  # type: ignore[arg-type]
                down_scale=d.down_scale, out=out, num_threads=threads,  # type: ignore[arg-type]
            )  # fmt: skip
            return out
        if self.store.buf is not None:
            _run_group(lay, list(self.store.units(lay, routed)), x, index, weights, out, threads)
            return out
        acc = torch.zeros(x.shape, dtype=torch.float32)
        for e, unit in self.store.units(lay, routed):
            _run_group(lay, [(e, unit)], x, index, weights, out, threads)
            acc.add_(out.float())
        return acc.to(x.dtype)

    # -- moves ----------------------------------------------------------------------------------

    def _to_host(self, t: Tensor) -> Tensor:
        return to_host(self.device, t)

    def _to_device(self, t: Tensor) -> Tensor:
        return to_device(self.device, t)


def _run_group(lay: ExpertsLayout, group: list[tuple[int, Tensor]], x: Tensor, index: Tensor, weights: Tensor, out: Tensor, threads: int) -> None:
    """:func:`run_native` over the experts of ``group`` (their units), ``index`` mapped to them."""
    local = torch.full_like(index, -1)
    gu: list[Tensor] = []
    dn: list[Tensor] = []
    gs: list[Tensor | None] = []
    ds: list[Tensor | None] = []
    for u, (e, unit) in enumerate(group):
        local[index == e] = u
        w = lay.weights(unit)
        for name, data, scales in (("gate_up_proj", gu, gs), ("down_proj", dn, ds)):
            parts = weight_parts(w[name])
            assert not isinstance(parts, str), parts
            data.append(parts.data)
            scales.append(parts.scale)
    quant = any(s is not None for s in gs)
    run_native(x, gu, dn, local, weights, gate_up_scale=gs if quant else None, down_scale=ds if quant else None, out=out, num_threads=threads)


def _routing(top_k_index: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """transformers' eager loop's routing: the one-hot mask ``[n + 1, k, rows]`` (index ``n``
    is where an expert-parallel rank's foreign experts go) and the experts hit, ``[hits, 1]``."""
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
        return expert_mask, torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()


def expert_out(m: Any, w: dict[str, Tensor], x: Tensor) -> Tensor:
    """One expert of transformers' eager loop on its rows ``x``: projection, gate, projection,
    the post-expert norm (the routing weight is the caller's)."""
    gate = "gate_up_proj" if m.has_gate else "up_proj"
    h = _project(x, w[gate], w.get(gate + "_bias"), m.is_transposed)
    h = m._apply_gate(h) if m.has_gate else m.act_fn(h)
    h = _project(h, w["down_proj"], w.get("down_proj_bias"), m.is_transposed)
    if getattr(m, "has_post_expert_norm", False):
        h = m.post_expert_norm(h)
    return h


def _expert(m: Any, w: dict[str, Tensor], current_state: Tensor, routing: Tensor) -> Tensor:
    """One expert of the eager loop with its routing weight."""
    return expert_out(m, w, current_state) * routing


class DeviceCache:
    """Units on the device (issue 34, point 4): ``capacity`` slots of the largest unit, a
    segmented LRU over them (``expertstore._Slru``). A copy into a slot waits for the compute
    issued before it (the slot's last readers) and is waited for by the host before the slot is
    read (a blocking copy on ``h2d_now``, as a CPU call's outputs go back)."""

    def __init__(self, device: Device, capacity: int, slot_bytes: int, meter: Any = None) -> None:
        self.device = device
        self.capacity = capacity
        self.slots = [device.empty(slot_bytes, torch.uint8, meter) for _ in range(capacity)]
        self.cache = _Slru(capacity)
        self.free = list(range(capacity))
        self.slot_bytes = slot_bytes
        self.nbytes = capacity * slot_bytes

    def get(self, layout: int, e: int) -> Tensor | None:
        key = (layout, e)
        slot = self.cache.get(key)
        if slot is None:
            return None
        self.cache.used(key)
        return self.slots[slot]

    def put(self, layout: int, e: int, host_unit: Tensor) -> Tensor:
        """``host_unit`` copied into a slot (the cache's first victim if none is free)."""
        if self.free:
            slot = self.free.pop()
        else:
            key, slot = next(self.cache.victims())
            self.cache.drop(key)
        self.cache.add((layout, e), slot)
        dev = self.device
        n = host_unit.numel()
        dev.stream_waits(dev.h2d_now, dev.record_current())  # after the compute that read the slot
        dev.copy_blocking([(self.slots[slot][:n], host_unit)], dev.h2d_now)
        return self.slots[slot]


def _project(x: Tensor, w: Tensor, b: Tensor | None, transposed: bool) -> Tensor:
    """The eager loop's projection: ``x @ w + b`` for transposed weights, ``F.linear`` else."""
    if transposed:
        return x @ w + b if b is not None else x @ w
    return F.linear(x, w, b) if b is not None else F.linear(x, w)


def _parent_of(model: torch.nn.Module, m: torch.nn.Module) -> torch.nn.Module | None:
    """The module that calls ``m`` (its parent: the sparse MoE block), whose call tells the phase."""
    for parent in model.modules():
        if any(c is m for c in parent.children()):
            return parent
    return None


def _leave_modes() -> list[Any]:
    """The torch-function modes active now (``NativeMatmul``, around a block run on the CPU, taken
    off: this function calls its own kernels); :func:`_enter_modes` puts them back as they were."""
    out = []
    while torch._C._len_torch_function_stack():
        out.append(torch._C._pop_torch_function_stack())
    for mode in reversed(out):
        if not isinstance(mode, NativeMatmul):
            torch._C._push_on_torch_function_stack(mode)
    return out


def _enter_modes(modes: list[Any]) -> None:
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in reversed(modes):
        torch._C._push_on_torch_function_stack(mode)


def experts_forward(self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """The offload's experts implementation (registered as :data:`NAME`): the routed experts of
    this call, read where they live (see the module documentation)."""
    held = self.__dict__.get(ATTR)
    if held is None:
        return _not_ours(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    owner, lay = held
    out: Tensor = owner.forward(self, lay, hidden_states, top_k_index, top_k_weights)
    return out


_PREVIOUS: dict[int, str | None] = {}  # id(config) -> its implementation before an offload switched it


def _not_ours(m: torch.nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    """A module this offload does not hold whose config it switched: the implementation the
    config named before (transformers' own lookup), else the class's eager forward."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    eager: Callable[..., Tensor] = type(m).forward.__wrapped__  # type: ignore[attr-defined]
    before = _PREVIOUS.get(id(m.config))
    fn = ALL_EXPERTS_FUNCTIONS.get_interface(before, eager) if before not in (None, NAME) else eager
    return fn(m, *args, **kwargs)


__all__ = ["ATTR", "NAME", "Decided", "Experts", "decide", "experts_forward", "expert_params", "find_experts", "is_fused_experts", "native_experts_faster", "run_native"]
