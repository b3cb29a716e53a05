"""Placement: where each call of a streamed block runs.

- ``"stream"`` (the default): its bytes are copied into the device's ring and it runs there.
- ``"cpu"``: it runs on the CPU from its host bytes (the pinned copy, or the RAM staging slot an
  NVMe page is read into); the call's tensors cross to the host before it and its outputs back
  after: at decode, the hidden states (kilobytes) instead of the block's weights. A decoder
  layer that runs on the CPU keeps its KV cache on the host.
- ``"auto"``: per call, the cheaper of the two by the cost model (``weights/costs.py``) for the
  call's rows: a decode step runs on the CPU where the host reads faster than PCIe carries, a
  long prompt streams. A layer whose KV cache a prompt wrote on the device moves it to the host
  when it first decodes there (counted: ``kv_bytes``).

For inference an embedding looks its rows up where its weights are, whatever the placement: only
the rows a call needs cross to the device. With ``device="cpu"`` (or no GPU) every call runs on
the CPU and nothing is copied. Training (a graph being built, or a backward) always streams, the
embedding included.

A call run on the CPU runs ``F.linear`` of at most ``hostmatmul.MAX_ROWS`` rows (a decode step)
on the native kernel where it applies (``hostmatmul.NativeMatmul``: bfloat16 weights, torchao's
int8 and fp8 weight-only ones; no gradient wanted), torch's kernels otherwise;
``offload_weights(native_matmul=False)``: torch's always.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from .costs import CostModel
from ..runtime.device import Device, HostDevice
from .blocks import Block, wrapped
from .hostmatmul import NativeMatmul, bf16_faster
from .plan import WeightPlan

PLACEMENTS = ("stream", "cpu", "auto")
CROSSED_KEPT = 8  # host copies of device tensors kept for the next CPU calls (HostCalls._crossed)


def _first_tensor(args: Any) -> Tensor | None:
    for a in args:
        if isinstance(a, Tensor):
            return a
    return None


def to_host(dev: Device, t: Tensor) -> Tensor:
    """A host copy of the device tensor ``t`` for a call computed on the host, made now: the d2h
    stream waits for the compute that made ``t`` (placement's and the routed experts' crossings)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    dev.stream_waits(dev.d2h, dev.record_current())  # after the compute that made it
    dev.copy_blocking([(out, t)], dev.d2h)
    return out


def to_device(dev: Device, t: Tensor) -> Tensor:
    """A device copy of the host result ``t``, made now on ``h2d_now``: it waits for the allocation,
    whose memory the caching allocator may hand out again at once."""
    out = dev.empty(t.numel(), t.dtype).view(t.shape)
    dev.stream_waits(dev.h2d_now, dev.record_current())  # after the allocation (memory reused at once)
    dev.copy_blocking([(out, t)], dev.h2d_now)
    return out


def call_shape(args: Any, kwargs: dict[str, Any] | None = None) -> tuple[int, int]:
    """(rows, rows per sequence) of a block call: its hidden states' rows, and the length of the
    sequence axis (1: a decode step). The hidden states are the first positional tensor, else the
    keyword ``hidden_states`` (an attention called as ``self_attn(hidden_states=...)``), else the
    first keyword tensor."""
    t = _first_tensor(args)
    if t is None and kwargs:
        hs = kwargs.get("hidden_states")
        t = hs if isinstance(hs, Tensor) else _first_tensor(kwargs.values())
    if t is None or t.dim() == 0:
        return 1, 1
    if t.dtype in (torch.int64, torch.int32):  # token ids (an embedding's call)
        return t.numel(), t.shape[-1] if t.dim() >= 1 else 1
    rows = t.numel() // max(t.shape[-1], 1)
    return rows, t.shape[-2] if t.dim() >= 2 else 1


class Placer:
    """Decides each call's placement and counts them by phase (see the module documentation)."""

    def __init__(self, plan: WeightPlan, blocks: list[Block], cost_model: CostModel | None) -> None:
        self.mode = plan.placement
        self.blocks = blocks
        self.cost_model = cost_model
        self.on_device = plan.on_device
        self.host_only = {b.index for b in plan.blocks if b.lookup}
        self.params = {b.index: sum(e.param.numel() for e in b.entries) for b in blocks}
        self.dtype = {b.index: b.entries[0].param.dtype if b.entries else torch.float32 for b in blocks}
        self.last: dict[int, str] = {}
        self.decided: dict[int, str] = {}  # id(module) -> where its current call runs
        self.reset_stats()

    def reset_stats(self) -> None:
        self.counts: dict[str, dict[str, int]] = {"prompt": {"stream": 0, "cpu": 0}, "decode": {"stream": 0, "cpu": 0}}
        self.per_block: dict[int, int] = {}

    def forwards(self) -> int:
        """The forwards since :meth:`reset_stats` as the calls show them: the fewest calls of a
        block that ran (each forward calls each block once, a block holding a tied embedding and
        head twice). The streamer counts a cycle where a backward ends it, never at inference:
        ``report()``'s ``passes`` read 0 there ("over 0 forwards") and is the larger of the two."""
        return min(self.per_block.values(), default=0)

    def decide(
        self, b: int, module: torch.nn.Module, args: Any, training: bool, kwargs: dict[str, Any] | None = None
    ) -> str:
        rows, seq = call_shape(args, kwargs)
        if not self.on_device:
            where = "cpu"
        elif training:
            where = "stream"  # its backward runs on the device, its gradient lands there
        elif isinstance(module, torch.nn.Embedding):
            where = "cpu"  # a lookup: only its rows cross
        elif self.mode == "auto":
            assert self.cost_model is not None
            where = self.cost_model.choose(self.blocks[b].nbytes, self.params[b], rows, self.dtype[b])
        else:
            where = self.mode
        self.counts["prompt" if seq > 1 else "decode"][where] += 1
        self.per_block[b] = self.per_block.get(b, 0) + 1
        self.last[b] = where
        return where

    def overrule(self, b: int, args: Any, where: str, kwargs: dict[str, Any] | None = None) -> str:
        """The call of ``b`` just decided (on ``args``) runs ``where`` instead (the streamer's
        verdict): counted there."""
        rows, seq = call_shape(args, kwargs)
        phase = self.counts["prompt" if seq > 1 else "decode"]
        phase[self.last[b]] -= 1
        phase[where] += 1
        self.last[b] = where
        return where

    def place(self, b: int, module: torch.nn.Module, call: tuple[Any, dict[str, Any]], training: bool, held: bool) -> str:
        """Where this call of ``module`` (block ``b``, on ``call``: its positional and keyword
        arguments) runs, decided, counted and settled (:meth:`where` answers it). ``held``: the
        block's weights are on the device already (held there by a read outside its module): a
        call the CPU would run runs there, its inputs are not moved to the host."""
        args, kwargs = call
        where = self.decide(b, module, args, training, kwargs)
        if where == "cpu" and held:
            where = self.overrule(b, args, "stream", kwargs)
        self.settle(module, where)
        return where

    def otherwise(self) -> str:
        """Where an activation the placer does not decide runs (a read by another module, a
        backward): on the device, unless there is none."""
        return "stream" if self.on_device else "cpu"

    def settle(self, module: torch.nn.Module, where: str) -> None:
        """``module``'s current call runs ``where`` (what :meth:`where` answers until its next call)."""
        self.decided[id(module)] = where

    def where(self, module: torch.nn.Module) -> str:
        """Where ``module``'s current call runs (its hooks on the CPU ask)."""
        return self.decided.get(id(module), self.otherwise())

    def predict(self, b: int) -> str:
        """Where ``b``'s next call will likely run (its last call's place): a block about to run
        on the CPU is not copied ahead to the device."""
        if b in self.host_only or not self.on_device:
            return "cpu"
        return self.last.get(b, "cpu" if self.mode == "cpu" else "stream")


def layer_index(modules: list[torch.nn.Module]) -> int | None:
    """The decoder layer index of a block (an attention's ``layer_idx``: its KV cache's slot)."""
    for m in modules:
        for c in m.modules():
            idx = getattr(c, "layer_idx", None)
            if isinstance(idx, int):
                return idx
    return None


def find_cache(args: Any, kwargs: dict[str, Any]) -> Any:
    """The KV cache a layer call is handed (transformers' ``Cache``: its ``layers``), if any, by
    keyword or by position (GPT-2's layers take it positionally)."""
    for v in (*args, *kwargs.values()):
        if hasattr(v, "layers") and callable(getattr(v, "update", None)) and isinstance(v.layers, list):
            return v
    return None


class HostCalls:
    """The module hooks of calls run on the CPU: their tensors to the host before, their outputs
    back after, the KV cache of their layer kept where the layer runs, the threads bounded, the
    time counted (``cpu_s``); with ``native_matmul``, ``NativeMatmul`` active from the outermost
    call on the CPU of a module whose weights the kernel may read (``kernel_reads``) to its end
    (off in a call nested in it that runs elsewhere). A module with none (bfloat16 weights where
    torch's kernel is the faster here, nothing quantized) runs without the mode: every torch
    operation under a mode passes through its Python ``__torch_function__`` (about 3 us each,
    80 a Llama layer: 0.24 ms a layer at decode, measured on the AMD EPYC Zen 4 VM)."""

    def __init__(
        self, device: Device, blocks: list[Block], placer: Placer, num_threads: int | None,
        native_matmul: bool | None = None,
    ) -> None:  # fmt: skip
        self.device = device
        self.moves = not isinstance(device, HostDevice)
        self.blocks = blocks
        self.placer = placer  # where each call runs
        self.num_threads = num_threads
        self.matmul: NativeMatmul | None = None
        if native_matmul is not False:
            bf16 = native_matmul is True or bf16_faster(num_threads or torch.get_num_threads())
            self.matmul = NativeMatmul(bf16=bf16)
        self.stack: list[tuple[str, float, int | None, bool]] = []  # (where, start, threads to restore, mode entered)
        self.lent: list[list[tuple[torch.nn.Module, str, Tensor]]] = []  # per CPU call: the device buffers its host copies replace
        self.buffers: dict[int, tuple[weakref.ref[Tensor], int, Tensor]] = {}  # id(device buffer) -> (it, its version, host copy)
        self.layer: dict[int, int | None] = {}
        self.kernel: dict[int, bool] = {}  # id(module) -> whether the kernel may read one of its weights
        self.handles: list[Any] = []
        # Device tensors handed to CPU calls, and their host copies: the mask and the position
        # embeddings every layer of a pass takes cross once (a copy is its tensor's while the
        # tensor lives at the same version; weakly held, the last few).
        self.crossed: list[tuple[weakref.ref[Tensor], int, Tensor, int]] = []
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"cpu_s": 0.0, "hidden_bytes": 0, "kv_bytes": 0}
        if self.matmul is not None:
            self.matmul.native_calls = self.matmul.torch_calls = 0

    def report(self) -> dict[str, Any]:
        """``stats`` and the ``F.linear`` calls of CPU-run blocks the native kernel ran
        (``native_calls``) and torch's (``torch_calls``)."""
        m = self.matmul
        # (torch_calls: those of the calls run under the mode; a module whose weights the kernel
        # does not read runs without it, its F.linear calls uncounted)
        return {
            **self.stats, "native_calls": m.native_calls if m else 0, "torch_calls": m.torch_calls if m else 0,
            "native_bf16": bool(m and m.bf16),
        }  # fmt: skip

    def kernel_reads(self, module: torch.nn.Module) -> bool:
        """Whether an ``F.linear`` of ``module`` (its submodules' too) may go to the native kernel:
        one of its parameters a 2-D tensor subclass (torchao's quantized weights: ``NativeMatmul``
        reads their parts at the call) or, where the mode takes bfloat16 weights, a 2-D bfloat16
        one. Judged by type, dtype and shape, which streaming keeps (it moves the bytes)."""
        m = self.matmul
        if m is None:
            return False
        return any(p.dim() == 2 and (wrapped(p) or (m.bf16 and p.dtype is torch.bfloat16)) for p in module.parameters())

    def attach(self, module: torch.nn.Module, block: int) -> None:
        self.layer[id(module)] = layer_index([module])
        self.kernel[id(module)] = self.kernel_reads(module)
        self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
        self.handles.append(module.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.crossed = []
        self.buffers = {}

    # -- moves ----------------------------------------------------------------------------------

    def _to_host(self, t: Tensor) -> Tensor:
        return to_host(self.device, t)

    def _to_device(self, t: Tensor) -> Tensor:
        return to_device(self.device, t)

    def _crossed(self, t: Tensor) -> Tensor:
        """``t``'s host copy: the one made for an earlier call if ``t`` has not changed since."""
        if not t.is_inference():
            for ref, v, copy, hv in self.crossed:
                if ref() is t and v == t._version and hv == copy._version:  # neither side changed since
                    return copy
        self.stats["hidden_bytes"] += t.numel() * t.element_size()
        out = self._to_host(t)
        self._remember(t, out)
        return out

    def _remember(self, t: Tensor, host: Tensor) -> None:
        """``host`` holds what the device tensor ``t`` holds now (until ``t`` changes)."""
        if t.is_inference() or host.is_inference():
            return  # (no version counter: a change could not be seen)
        self.crossed = [c for c in self.crossed[-(CROSSED_KEPT - 1) :] if c[0]() is not None]
        self.crossed.append((weakref.ref(t), t._version, host, host._version))

    def _on_device(self, t: Tensor) -> bool:
        return t.device.type == self.device.torch_device.type

    def _kv(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], where: str) -> None:
        """The KV cache of this layer moved to the side the call runs on, judged by where its
        tensors are (not by the layer's history: a cache may append its layers lazily, at their
        first update, after a call that recorded nothing)."""
        idx = self.layer.get(id(module))
        cache = find_cache(args, kwargs) if idx is not None else None
        if cache is None or idx is None or idx >= len(cache.layers):
            return  # no layer yet: made where this call runs
        on_host = where == "cpu"
        layer = cache.layers[idx]
        for attr in ("keys", "values"):
            t = getattr(layer, attr, None)
            if isinstance(t, Tensor) and t.numel() and self._on_device(t) == on_host:
                moved = self._to_host(t) if on_host else self._to_device(t)
                setattr(layer, attr, moved)
                self.stats["kv_bytes"] += t.numel() * t.element_size()
                if hasattr(layer, "device"):
                    layer.device = moved.device

    def _lend_buffers(self, module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Tensor]]:
        """The device buffers of ``module`` (and its submodules) replaced, for a call on the CPU,
        by their host copies (made once while a buffer does not change: DeepSeek-V3's router
        reads its ``e_score_correction_bias``); what ``_post`` puts back. A call on the CPU that
        wrote a buffer would write the copy: inference writes none."""
        lent = []
        for m in module.modules():
            for name, buf in m._buffers.items():
                if isinstance(buf, Tensor) and self._on_device(buf):
                    lent.append((m, name, buf))
                    known = self.buffers.get(id(buf))
                    if known is None or known[0]() is not buf or known[1] != buf._version:
                        known = self.buffers[id(buf)] = (weakref.ref(buf), buf._version, self._to_host(buf))
                    m._buffers[name] = known[2]
        return lent

    def _pre(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        where = self.placer.where(module)
        threads = None
        if where == "cpu" and self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            threads = torch.get_num_threads()
            torch.set_num_threads(self.num_threads)
        entered = False
        if self.matmul is not None:
            if (
                where == "cpu" and self.kernel.get(id(module), True) and not torch.compiler.is_compiling()
                and not any(e for _, _, _, e in self.stack)
            ):  # fmt: skip
                self.matmul.__enter__()  # the outermost call on the CPU the kernel may serve: F.linear to it from here
                entered = True
            self.matmul.on = where == "cpu"
        self.stack.append((where, time.perf_counter(), threads, entered))
        if not self.moves:
            return None
        self._kv(module, args, kwargs, where)
        if where != "cpu":
            return None
        self.lent.append(self._lend_buffers(module))

        def host(x: Any) -> Any:
            if isinstance(x, Tensor) and self._on_device(x):
                return self._crossed(x)
            return x

        return tree_map(host, tuple(args)), tree_map(host, kwargs)

    def _post(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        if not self.stack:
            return None
        where, t0, threads, entered = self.stack.pop()
        if threads is not None:
            torch.set_num_threads(threads)
        if self.matmul is not None:
            if entered:
                self.matmul.leave()
            self.matmul.on = bool(self.stack) and self.stack[-1][0] == "cpu"
        if where == "cpu" and not any(w == "cpu" for w, _, _, _ in self.stack):
            self.stats["cpu_s"] += time.perf_counter() - t0  # (the outermost: a block calling blocks counts once)
        if where != "cpu" or not self.moves:
            return None
        if self.lent:
            for m, name, buf in self.lent.pop():
                m._buffers[name] = buf

        def back(x: Any) -> Any:
            if isinstance(x, Tensor) and x.device.type == "cpu":
                self.stats["hidden_bytes"] += x.numel() * x.element_size()
                out = self._to_device(x)
                self._remember(out, x)  # the next layer on the CPU takes it as it was: no copy back
                return out
            return x

        return tree_map(back, out)
