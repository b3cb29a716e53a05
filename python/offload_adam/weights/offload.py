"""``offload_weights``: a model's weights kept on the host (pinned RAM or NVMe) and streamed to
the device block by block, ahead of need (see ``streamer.py``), with whole blocks resident on
the device as far as ``gpu_budget_gb`` allows; ``plan_weights``: what it would build.

The offload is built from its plan (``plan.py``: a ``WeightPlan``, made here from the model's
blocks and the arguments, or a user's edited one): the build decides nothing. ``WeightOffload``
reads plan, sources, fill, homes, placer, streamer and the CPU calls' hooks, in that order, under
an ``Undo`` that puts the model back if any step fails."""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..runtime import checks
from ..runtime.device import HOST, Device, HostDevice, Meter, default_device, device_for, set_data, stream_device, swap
from ..runtime.hosted import Home, claimed, set_home, wait_for_writer
from ..runtime.pinned import PinnedArena, trim_host_memory
from . import arguments, costs, progress, summary
from .blocks import Block, Entry, find_blocks, wrapped
from .experts import DeviceCache, Experts, expert_params, find_experts
from .expertstore import ExpertsLayout, ExpertStore
from .checkpoint import Checkpoint, ExpertSources
from .loader import placeholders
from .placement import PLACEMENTS, HostCalls, Placer
from .plan import WeightPlan, describe, experts_plan, make_plan, staging_slots, warn_capped
from .quantize import Quantizer, quantize_blocks, quantizer
from .rows import RowLookups
from .storage import HostWeights, NvmeWeights, Sources
from .streamer import Streamer
from .undo import Undo, from_copy

GiB = 1 << 30
STORAGES = ("cpu", "nvme")
ATTR = "_offload_adam_weights"  # the model keeps its handle (and so the streamer) alive
log = logging.getLogger("offload_adam")


@dataclass
class _Args:
    """``offload_weights``' arguments, checked (``raw``: as given, what a plan keeps)."""

    device: Device
    storage: str
    nvme_dir: Any
    checkpoint: Any
    gpu_budget_gb: float | None
    prefetch: int
    blocks: list[torch.nn.Module] | None
    placement: str
    host_budget_gb: float | None
    num_threads: int | None
    cost_model: costs.CostModel | None
    quantize: Quantizer | None
    native_matmul: bool | None
    keep: frozenset[int]
    raw: dict[str, Any]


def _prepare(model: torch.nn.Module, a: _Args, undo: Undo) -> tuple[list[Block], Any, list[ExpertsLayout]]:
    """The model made ready to be cut into blocks (tied, quantized), and its blocks; the
    checkpoint still to read (None once quantize= has read it); its fused routed experts, which
    are in no block (``experts.py``: stored per expert). ``undo`` puts it back."""
    checkpoint = a.checkpoint
    tie = getattr(model, "tie_weights", None)
    if checkpoint is not None and callable(tie):
        # As accelerate's load_checkpoint_and_dispatch: an empty model (init_empty_weights)
        # may come untied, and save_pretrained writes a tied parameter under one name only.
        tie()
    if a.quantize is not None:
        quantize_blocks(model, a.blocks, checkpoint, a.quantize, a.keep, undo)
        checkpoint = None  # (read: the model is on the host now, quantized)
    routed = find_experts(model, a.keep, checkpoint is not None)
    return find_blocks(model, a.blocks, a.keep | expert_params(routed)), checkpoint, routed


def _buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Tensor]]:
    return [(m, name, buf) for m in model.modules() for name, buf in m._buffers.items() if buf is not None]


def _plan_of(model: torch.nn.Module, blocks: list[Block], a: _Args, routed: list[ExpertsLayout]) -> WeightPlan:
    """The plan of ``blocks`` and the expert store of ``routed`` under the arguments ``a`` (pure:
    see ``plan.py``)."""
    kept = [p for p in model.parameters() if id(p) in a.keep]
    buffer_bytes = sum(b.numel() * b.element_size() for _, _, b in _buffers(model)) + sum(p.numel() * p.element_size() for p in kept)
    on_device = not isinstance(a.device, HostDevice)
    p = make_plan(
        describe(blocks), device=str(a.device.torch_device) if on_device else "cpu", storage=a.storage,
        placement=a.placement, prefetch=a.prefetch, buffer_bytes=buffer_bytes, on_device=on_device,
        gpu_budget=None if a.gpu_budget_gb is None else int(a.gpu_budget_gb * GiB),
        host_budget=None if a.host_budget_gb is None else int(a.host_budget_gb * GiB),
    )  # fmt: skip
    p.args = dict(a.raw)
    p.experts = experts_plan(p, [(lay.experts, lay.unit_bytes) for lay in routed])
    return p


def _matched(plan: WeightPlan, found: WeightPlan) -> WeightPlan:
    """``plan`` (a user's, maybe edited), once its blocks are seen to be the model's: the plan
    ``found`` made for them (names and bytes)."""
    if len(plan.blocks) != len(found.blocks):
        raise ValueError(f"plan: {len(plan.blocks)} blocks, the model has {len(found.blocks)} (a plan of another model?)")
    for mine, theirs in zip(plan.blocks, found.blocks):
        if (mine.name, mine.nbytes) != (theirs.name, theirs.nbytes):
            raise ValueError(
                f"plan: block {mine.index} is {mine.name} of {mine.nbytes} bytes, the model's is {theirs.name} of "
                f"{theirs.nbytes} bytes (a plan of another model?)"
            )
    if (plan.device, plan.on_device) != (found.device, found.on_device):
        raise ValueError(f"plan: made for device {plan.device}, the offload runs on {found.device}")
    return plan


def _check_model(model: torch.nn.Module, checkpoint: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, ATTR, None) is not None:
        raise ValueError("model: its weights are offloaded already (close() the first offload)")
    for n, p in model.named_parameters():
        who = claimed(p)
        if who is not None:
            raise ValueError(
                f"model: {n} is held by {who}, which imported its storage; call offload_weights before building "
                "the optimizer (AdamW(model.parameters()) then trains the streamed weights)"
            )
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type not in ("cpu", "meta"):
            raise ValueError(
                f"model: {n} is on {t.device}; offload_weights takes a model on the CPU (build it there, "
                "or with accelerate.init_empty_weights() and checkpoint=) and puts on the device what fits"
            )
    for n, p in model.named_parameters():
        if p.device.type == "meta" and checkpoint is None:
            raise ValueError(f"model: parameter {n} is on the meta device: pass checkpoint= to load the weights")
    for n, b in model.named_buffers():
        if b.device.type == "meta":
            raise ValueError(f"model: buffer {n} is on the meta device (build with init_empty_weights(include_buffers=False))")


def _restore(h: WeightOffload, lost: list[tuple[str, BaseException]]) -> None:
    """``WeightOffload.close()``'s middle: every block's and every routed expert's parameters
    back on the host from where they live; what cannot be read is noted in ``lost`` (its
    parameters left on the meta device)."""
    for b in h.blocks:
        if b.index in h.resident:
            for e in b.entries:
                e.attach([h._to_host(t) for t in e.tensors()])
            continue
        try:
            data = h.sources.of(b).read(b)
        except OSError as err:
            lost.append((b.name, err))
            for e in b.entries:
                _to_meta(e)
            continue
        for e in b.entries:
            e.attach([v.clone() for v in e.views(data)])
    if h.experts is not None:
        for lay in h.experts.layouts:
            try:
                h.experts.store.restore(lay)
            except OSError as err:
                lost.append((lay.name, err))


def _to_meta(e: Entry) -> None:
    """``e``'s parameter (the same object, for every module holding it) onto the meta device: its
    weights are lost, and a read of it fails loudly."""
    swap(e.param, e.rebuild([torch.empty(q.shape, dtype=q.dtype, device="meta") for q in e.parts]))


def _nvme_source(p: WeightPlan, device: Device, arena: PinnedArena, nvme_dir: Any, disk: list[Block]) -> NvmeWeights:
    """The blocks ``disk`` on NVMe, read into the RAM ring the plan sized (``host_ring_plan``)."""
    hr = p.host_ring
    if p.on_device or not disk:
        return NvmeWeights(device, arena, nvme_dir, disk, staging_slots(p.ahead, len(disk), p.on_device))
    own = dict(hr.own) | {i: p.blocks[i].nbytes for i in hr.rows}  # (an embedding's: only to fill it, or read it whole)
    return NvmeWeights(device, arena, nvme_dir, disk, hr.slots, page=hr.page, own=own, transient=hr.rows)


def _row_lookups(p: WeightPlan, blocks: list[Block], sources: Sources, streamer: Streamer, undo: Undo) -> RowLookups | None:
    """The embeddings on NVMe looked up by their rows (``rows.py``), with the CPU as the device."""
    rows = sorted(p.host_ring.rows) if not p.on_device else []
    if not rows or sources.nvme is None:
        return None
    lookups = RowLookups(sources.nvme, [blocks[i] for i in rows])
    undo.add(lookups.close)
    streamer.rows = lookups
    return lookups


class WeightOffload:
    """The handle :func:`offload_weights` returns: ``plan`` (what it built: see
    :func:`plan_weights`), ``report()``, ``reset_stats()``, ``close()``."""

    def __init__(self, model: torch.nn.Module, a: _Args, plan: WeightPlan | None = None) -> None:
        self.model = model
        self.device = device = a.device
        self.num_threads = a.num_threads
        self.native_matmul = a.native_matmul
        with Undo(model) as undo:  # (a failure puts the model back as it was: see undo.py)
            self.blocks, checkpoint, routed = _prepare(model, a, undo)
            found = _plan_of(model, self.blocks, a, routed)
            self.plan = found if plan is None else _matched(plan, found)
            # (the expert store follows the blocks' homes, which a plan given may have edited)
            self.plan.experts = experts_plan(self.plan, [(lay.experts, lay.unit_bytes) for lay in routed])
            warn_capped(self.plan, 4)
            # resident=: parameters in no block, on the device for the whole offload (as buffers)
            self.kept = [p for p in model.parameters() if id(p) in a.keep]
            self.meter = Meter()
            self.arena = PinnedArena(device)
            self.sources = self._sources(a.nvme_dir)
            for src in self.sources:
                undo.add(src.close)
            self.placeholders = placeholders(device, [self.blocks[i] for i in self.streamed], self.meter)
            ck = Checkpoint(checkpoint) if checkpoint is not None else None
            try:
                # (the experts' tensors found first: their names are the checkpoint's too)
                located = ck.locate_experts(routed) if ck is not None else None
                self._fill(ck, _buffers(model), undo, located.used if located is not None else set())
                for src in self.sources:
                    src.pin()
                self.experts = self._experts(routed, a.nvme_dir, undo, ck, located)
            finally:
                if ck is not None:
                    ck.close()
            self.homes = self._homes(undo)
            self.placer = self._placer(a.cost_model)
            if self.experts is not None:
                self.experts.cost_model = self.placer.cost_model  # (placement="auto": a miss on the device copied or run on the CPU)
            triggers = {id(m): b.index for b in self.blocks for m in b.modules}
            guess = [triggers[id(m)] for m in model.modules() if id(m) in triggers]
            self.streamer = Streamer(device, self.blocks, self.plan, self.sources, self.meter, guess, self.placeholders, self.homes, self.placer)
            undo.add(self.streamer.close)
            self.host_calls = self._host_calls(undo)
            self.rows = _row_lookups(self.plan, self.blocks, self.sources, self.streamer, undo)
            if self.experts is not None:
                self.experts.attach(model)  # (the last change: the model's experts run ours from here)
                undo.add(self.experts.detach)
            self.closed = False
            setattr(model, ATTR, self)

    # -- the plan's figures, as the handle has always named them ---------------------------------

    @property
    def prefetch(self) -> int:
        """The prefetch used (never more than the streamed blocks)."""
        return self.plan.ahead

    @property
    def resident(self) -> set[int]:
        return self.plan.resident

    @property
    def streamed(self) -> list[int]:
        return self.plan.streamed

    # -- building -------------------------------------------------------------------------------

    def _sources(self, nvme_dir: Any) -> Sources:
        """Where the streamed blocks live: pinned RAM, NVMe pages, or both (``host_budget_gb``)."""
        p = self.plan
        ram = [self.blocks[i] for i in p.streamed if p.blocks[i].home == "ram"]
        disk = [self.blocks[i] for i in p.on_nvme]
        host = HostWeights(self.arena, ram) if ram or p.storage == "cpu" else None
        try:
            nvme = _nvme_source(p, self.device, self.arena, nvme_dir, disk) if p.storage == "nvme" else None
        except BaseException:
            if host is not None:
                host.close()
            raise
        return Sources(host, nvme, {b.index for b in ram})

    def _experts(
        self, routed: list[ExpertsLayout], nvme_dir: Any, undo: Undo, ck: Checkpoint | None = None, found: ExpertSources | None = None
    ) -> Experts | None:
        """The fused routed experts stored per expert (``expertstore.py``), in RAM or on the SSD
        with a RAM cache of what ``host_budget_gb`` leaves after the plan's RAM tier (the dense
        blocks it keeps and its ring: a dense part is read every token, an expert only when
        routed), their parameters on the meta device meanwhile. With a checkpoint (``ck``), each
        unit is read from it alone (``checkpoint.py``: fused or per-expert tensors)."""
        if not routed:
            return None
        p = self.plan
        xp = p.experts  # (the plan's expert store: its caches' sizes, as plan_weights says them)
        assert xp is not None
        capacity = xp.cache_units
        store = ExpertStore(routed, self.arena, nvme_dir if p.storage == "nvme" else None, capacity)
        undo.add(store.close)
        for lay in routed:
            if found is not None and ck is not None:
                pieces = [found.pieces[(lay.index, ep.name)] for ep in lay.params]
                store.fill_from(lay, lambda e, unit, pieces=pieces: ck.read_pieces([x for per in pieces for x in per[e]], unit))  # type: ignore[misc]
            else:
                store.fill(lay)
            for ep in lay.params:
                if ep.param.device.type == "meta":
                    continue  # (filled from the checkpoint: a failure leaves it there)
                _to_meta(Entry(ep.param, [f"{lay.name}.{ep.name}"]))
                undo.keep(ep.param, functools.partial(store.restore, lay, [ep]))
            trim_host_memory()
        store.pin()
        gpu = DeviceCache(self.device, xp.gpu_units, xp.gpu_bytes // xp.gpu_units, self.meter) if xp.gpu_units else None
        return Experts(self.device, routed, store, self.native_matmul, self.num_threads, gpu)

    def _homes(self, undo: Undo) -> dict[int, list[Home]]:
        """Each streamed parameter's home: its host copy, which an optimizer's step writes (the
        next forward streams it from there); NVMe keeps none in memory."""
        homes: dict[int, list[Home]] = {}
        undo.add(self._unset_homes)  # (undone before the fill: a parameter with a home, a weak reference, cannot be swapped back)
        self.homes = homes
        for i in self.streamed:
            b = self.blocks[i]
            host = self.sources.of(b).view(b)
            homes[i] = [Home(e.view(host) if host is not None and not e.wrapped else None, self.device, b.name) for e in b.entries]
            for e, h in zip(b.entries, homes[i]):
                set_home(e.param, h)
        return homes

    def _placer(self, cost_model: costs.CostModel | None) -> Placer:
        """Where each call runs; with placement="auto", the cost model, and where its figures
        came from (report(), the log)."""
        self.cost_model: dict[str, str] | None = None
        if self.plan.placement == "auto":
            dtype = next((e.param.dtype for b in self.blocks for e in b.entries), torch.bfloat16)
            if cost_model is None:
                cost_model = costs.cached_model(dtype)
            self.cost_model = cost_model.describe(dtype)
            log.info("offload_adam: placement='auto' costs calls with %s", "; ".join(f"{k} {v}" for k, v in self.cost_model.items()))
        return Placer(self.plan, self.blocks, cost_model)

    def _host_calls(self, undo: Undo) -> HostCalls | None:
        """The hooks of calls run on the CPU (tensors across, KV cache, threads, time): every
        streamed block's modules that may run there, and with the CPU as the device every block's.
        A streamed embedding is looked up on the host under every placement (its rows cross, not
        its table): its block's modules get the hooks too."""
        on_device = self.plan.on_device
        looked_up = {i for i in self.streamed if any(isinstance(m, torch.nn.Embedding) for m in self.blocks[i].modules)}
        placement = self.plan.placement
        if not (placement != "stream" or self.num_threads is not None or (on_device and looked_up)):
            return None
        cpu_runs = placement != "stream" or not on_device  # blocks other than lookups run on the CPU
        hc = HostCalls(self.device, self.blocks, self.placer, self.num_threads, self.native_matmul if cpu_runs else False)
        undo.add(hc.close)
        streamed = set(self.streamed)
        for b in self.blocks:
            if (b.index in streamed and (cpu_runs or b.index in looked_up)) or not on_device:
                for m in b.modules:
                    hc.attach(m, b.index)
        return hc

    def _fill(self, ck: Checkpoint | None, buffers: list[tuple[torch.nn.Module, str, Tensor]], undo: Undo, used: set[str]) -> None:
        """Every block's bytes into their storage (streamed) or device memory (resident), from
        the model's own tensors or the checkpoint, block by block, its parameters then pointed
        at their placeholders or device copies; ``undo`` records how to put each back (see
        ``undo.py``). A block copied into host memory (the pinned copy, blocks kept in RAM, the
        CPU as the device) lets its own tensors go at once, and the storage's memory is touched
        only as it is filled (pinned after), so the host holds the model at most once, plus a
        block; the others' tensors are kept until the offload is complete (the host holds them
        anyway: they go to NVMe or the GPU)."""
        dev = self.device
        where = ck.locate(self.blocks, set(self.model.state_dict(keep_vars=True)) | used) if ck is not None else {}
        every_resident = self.resident
        for b in progress.blocks(self.blocks, len(self.blocks), "offload_weights: filling blocks"):  # (a bar on a terminal, past 3 s)
            resident = b.index in every_resident
            src = self.sources.of(b)
            dst = torch.empty(b.nbytes, dtype=torch.uint8) if resident else src.staging(b)
            if ck is not None:
                ck.read_block(b, where, dst)
            else:
                for e in b.entries:
                    for v, t in zip(e.views(dst), e.tensors()):
                        v.copy_(t)
            host: Tensor | None = None  # the block's copy in host memory, if it has one
            if resident:
                outs = [q.shaped(dev.empty(q.numel, q.dtype, self.meter)) for q in b.parts]
                dev.stream_waits(dev.h2d, dev.record_current())  # after the allocation (memory reused at once)
                dev.copy_blocking([(o, q.view(dst)) for q, o in zip(b.parts, outs)], dev.h2d)
                cuts = [0, *itertools.accumulate(len(e.parts) for e in b.entries)]
                parts = [outs[i:j] for i, j in zip(cuts, cuts[1:])]
                copied = isinstance(dev, HostDevice)  # (the CPU as the device: this copy is theirs, ordinary host tensors)
            else:
                src.store_block(b)
                host = src.view(b)
                copied = host is not None
                parts = self.placeholders[b.index]
            for e, part in zip(b.entries, parts):
                on_meta = e.param.device.type == "meta"
                back = e.attach(part)
                if not copied or on_meta or undo.holds(e.param):
                    undo.keep(e.param, back)
                elif host is not None:
                    undo.keep(e.param, from_copy(e, host))
                del back  # (its own tensors go, unless kept)
            trim_host_memory()  # (the block's former tensors)
        moved: dict[int, Tensor] = {}
        for m, name, buf in buffers:
            out = moved.get(id(buf))
            if out is None:
                out = moved[id(buf)] = self._to_device(buf)
            m._buffers[name] = out  # (undo puts the modules' buffers back)
        for p in self.kept:
            undo.hold(p)
            set_data(p, self._to_device(p.detach()))

    def _unset_homes(self) -> None:
        for i in self.homes:
            for e in self.blocks[i].entries:
                set_home(e.param, None)

    # -- reports --------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """What the offload holds and moved: ``gpu_peak_bytes`` (the most device memory it
        allocated at once: ring, resident blocks, buffers), ``gpu_resident_bytes`` (resident
        blocks and buffers), ``ring_bytes``, ``host_pinned_bytes``, ``host_resident_bytes`` (blocks
        kept in RAM by ``host_budget_gb``), ``host_ring_bytes`` (the RAM pages NVMe blocks are read
        ahead into), ``nvme_bytes``, ``weights_bytes`` (every block), ``streamed_bytes``; since the
        last :meth:`reset_stats`: ``h2d_bytes`` and ``h2d_s`` (time the copies took on the
        device), ``stall_s`` (time compute waited for a weight), ``passes`` (forwards), ``loads``
        and ``on_demand_loads`` (loads not prefetched), ``calls`` (per phase, ``"prompt"`` and
        ``"decode"``, how many block calls ran ``"stream"`` and ``"cpu"``), ``cpu_s`` (time in
        blocks run on the CPU), ``hidden_bytes`` and ``kv_bytes`` (what crossed for them),
        ``native_calls`` and ``torch_calls`` (their ``F.linear`` calls the native kernel ran, and
        torch's, of the blocks with a weight it may read: see ``native_matmul``; ``native_bf16``:
        whether bf16 weights go to it), and with
        ``storage="nvme"`` ``read_bytes`` and ``io_wait_s`` (host time waiting for the disk); and
        the host's state now: ``host_rss_peak_bytes`` (the process's peak resident memory) and
        ``page_cache_bytes`` (of this offload's own files: ``O_DIRECT`` keeps it near 0); with
        ``placement="auto"``, ``cost_model``: each figure its choices take and where it came from
        (``weights/costs.py``; None otherwise)."""
        ld = self.streamer.loader
        p = self.plan
        h2d_s, stall_s = ld.timings()
        resident = sum(self.blocks[i].nbytes for i in p.resident) + sum(
            t.numel() * t.element_size() for t in [*self.model.buffers(), *self.kept]
        )
        hc = (
            self.host_calls.report()
            if self.host_calls is not None
            else {"cpu_s": 0.0, "hidden_bytes": 0, "kv_bytes": 0, "native_calls": 0, "torch_calls": 0, "native_bf16": False}
        )
        out: dict[str, Any] = {
            "device": p.device,
            "placement": p.placement,
            "cost_model": self.cost_model,
            "gpu_peak_bytes": self.meter.peak if p.on_device else 0,
            "gpu_resident_bytes": resident if p.on_device else 0,
            "ring_bytes": self.streamer.ring.nbytes,
            "host_pinned_bytes": self.arena.nbytes if p.on_device else 0,
            "host_resident_bytes": (resident if not p.on_device else 0) + sum(self.blocks[i].nbytes for i in p.in_ram),
            "host_ring_bytes": sum(s.ring_bytes for s in self.sources),
            "nvme_bytes": sum(s.nvme_bytes for s in self.sources),
            "weights_bytes": sum(b.nbytes for b in p.blocks),
            "streamed_bytes": sum(p.blocks[i].nbytes for i in p.streamed),
            "h2d_bytes": ld.stats["h2d_bytes"],
            "h2d_s": h2d_s,
            "stall_s": stall_s,
            "passes": max(ld.stats["passes"], self.placer.forwards()),  # (the streamer counts training's cycles only)
            "loads": ld.stats["loads"],
            "on_demand_loads": ld.stats["on_demand"],
            "calls": {ph: dict(c) for ph, c in self.placer.counts.items()},
            **hc,
            "host_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "page_cache_bytes": sum(s.page_cache_bytes() for s in self.sources),
            "blocks": len(p.blocks),
            "streamed_blocks": len(p.streamed),
            "prefetch": p.ahead,
            "storage": p.storage,
        }
        for s in self.sources:
            out.update(s.io_stats())
        if self.experts is not None:
            out.update(self.experts.report())
            out["page_cache_bytes"] += self.experts.store.page_cache_bytes()
        return out

    def __repr__(self) -> str:
        return summary.describe(self.report(), self.closed)  # (weights/summary.py)

    def summary(self, *, ttft_s: float | None = None, tokens_per_s: float | None = None, read_gbs: float | None = None) -> str:
        """The account of :meth:`report` in words, a line per subject: storage, device, placement
        and blocks; VRAM (with a device), RAM, NVMe and page cache; bytes per forward and waits
        (since :meth:`reset_stats`, once a forward ran); the caller's timings where given; block
        calls per phase (once there were any); the bound (forwards/s the bytes per forward allow).
        Figures that do not apply are left out (``weights/summary.py``).

        Args:
            ttft_s: the caller's time to first token, in seconds (default: None, not shown).
            tokens_per_s: the caller's decode rate (default: None, not shown).
            read_gbs: with the CPU as the device, the SSD's read rate in GB/s the bound divides
                (default: None, this machine's calibration's; without one the bound says so). On a
                device the bound is the measured host-to-device bandwidth of this run's copies.
        """
        return summary.summary(self.report(), ttft_s=ttft_s, tokens_per_s=tokens_per_s, read_gbs=read_gbs)

    def reset_stats(self) -> None:
        """Starts the counters of ``report()`` (bytes moved, times, loads, calls) afresh."""
        self.streamer.loader.reset_stats()
        self.placer.reset_stats()
        if self.host_calls is not None:
            self.host_calls.reset_stats()
        for s in self.sources:
            s.reset_stats()
        if self.experts is not None:
            self.experts.reset_stats()

    # -- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Every parameter back on the host as an ordinary tensor equal to its current value,
        buffers too; the device memory, the pinned memory and the files freed, always (a second
        call does nothing).

        Weights an optimizer trains are handed back as they are (the last step's, bitwise): the
        optimizer then refuses to step them (its ``state_dict()`` still works). A block whose
        bytes cannot be read back (a corrupted NVMe page, an I/O error) leaves its parameters on
        the meta device; once everything else is freed, one error names them."""
        if self.closed:
            return
        self.closed = True
        lost: list[tuple[str, BaseException]] = []
        try:
            for hs in self.homes.values():
                for h in hs:
                    h.ready.wait()  # an asynchronous step still writing it
                    h.release()  # its writer may no longer step it
            for p in self.kept:
                # An asynchronous step still to queue its copy-back into the device tensor that
                # the host copy replaces below (CUDA review, second pass, hazard 8).
                wait_for_writer(p)
            self._unset_homes()
            if self.host_calls is not None:
                self.host_calls.close()
            if self.experts is not None:
                self.experts.detach()
            if self.rows is not None:
                self.rows.close()
            # Every stream, the user's included, before the ring is freed: a forward under
            # torch.cuda.stream(s) may still read it, and memory freed first could go to another
            # thread's allocation meanwhile (a cold path: one synchronize).
            self.device.synchronize()
            self.streamer.close()
            _restore(self, lost)
            for m in self.model.modules():
                for name, buf in m._buffers.items():
                    if buf is not None:
                        m._buffers[name] = self._to_host(buf)
            for p in self.kept:
                set_data(p, self._to_host(p.detach()))
        finally:
            try:
                if self.experts is not None:
                    self.experts.store.close()
                for s in self.sources:
                    s.close()
            finally:
                self.streamer.loader.placeholders = self.placeholders = {}
                if getattr(self.model, ATTR, None) is self:
                    delattr(self.model, ATTR)
        if lost:
            names = [n for b in self.blocks for e in b.entries if e.param.device.type == "meta" for n in e.names[:1]]
            names += [f"{lay.name}.{ep.name}" for lay in (self.experts.layouts if self.experts else []) for ep in lay.params if ep.param.device.type == "meta"]
            first = lost[0][1]
            raise OSError(
                first.errno if isinstance(first, OSError) and first.errno else errno.EIO,
                f"offload_adam: close(): the weights of {len(lost)} block(s) could not be read back "
                f"({'; '.join(str(err) for _, err in lost)}); everything else was freed and handed back. "
                f"These parameters are left on the meta device: {', '.join(names)}",
            )

    def _to_device(self, t: Tensor) -> Tensor:
        out = self.device.empty(t.numel(), t.dtype, self.meter).view(t.shape)
        self.device.stream_waits(self.device.h2d, self.device.record_current())  # after the allocation
        self.device.copy_blocking([(out, t)], self.device.h2d)
        return out

    def _to_host(self, t: Tensor) -> Tensor:
        out = torch.empty(t.shape, dtype=t.dtype)
        self.device.stream_waits(self.device.d2h, self.device.record_current())  # after its last writer
        self.device.copy_blocking([(out, t)], self.device.d2h)
        return out

    def __enter__(self) -> WeightOffload:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_DEFAULTS: dict[str, Any] = {
    "device": None, "storage": "cpu", "nvme_dir": None, "checkpoint": None, "gpu_budget_gb": None, "prefetch": 2,
    "blocks": None, "placement": "stream", "host_budget_gb": None, "num_threads": None, "cost_model": None,
    "quantize": None, "native_matmul": None, "resident": None,
}  # offload_weights' defaults (a plan's arguments are given over them)


def offload_weights(
    model: torch.nn.Module,
    device: Any = None,
    *,
    storage: str = "cpu",
    nvme_dir: Any = None,
    checkpoint: Any = None,
    gpu_budget_gb: float | None = None,
    prefetch: int = 2,
    blocks: list[torch.nn.Module] | None = None,
    placement: str = "stream",
    host_budget_gb: float | None = None,
    num_threads: int | None = None,
    cost_model: costs.CostModel | None = None,
    quantize: Any = None,
    native_matmul: bool | None = None,
    resident: Callable[[str, torch.nn.Parameter], bool] | None = None,
    plan: WeightPlan | None = None,
) -> WeightOffload:
    """Keeps ``model``'s weights on the host and streams them to ``device`` block by block,
    ahead of need, for inference and for training (build the optimizer after this call; the step
    then writes the host copy the next forward streams); or runs blocks on the CPU from their host
    copy where that is cheaper (``placement``), or the whole model on the CPU (``device="cpu"``,
    or no GPU: with ``storage="nvme"`` a model larger than the RAM runs).

    Each layer of a ``ModuleList`` of repeated layers is a block, and so is each other module
    with parameters of its own. The device holds a ring of ``prefetch + 1`` slots of the largest
    streamed block, plus the blocks kept resident within ``gpu_budget_gb``. Outside its block's
    forward a streamed parameter reads NaN (never stale weights): read weights after ``close()``.

    For example::

        h = offload_adam.offload_weights(model, gpu_budget_gb=20)     # 24 GB card: most blocks stay
        out = model.generate(input_ids.cuda(), max_new_tokens=64)
        print(h.report()); h.close()                                  # weights back on the host

    Args:
        model: an ``nn.Module`` on the CPU with float32, bfloat16 or float16 parameters, or
            quantized ones (tensor subclasses that flatten, as torchao's); or built with
            ``accelerate.init_empty_weights()``, with ``checkpoint``.
        device: the device to run on (default: None, the current CUDA device; inside
            ``offload_adam.testing.simulated_device()``, the simulated device; without either,
            the CPU). ``"cpu"``: the whole model runs on the CPU, its blocks from RAM (within
            ``host_budget_gb`` with ``storage="nvme"``, the others read ahead from the SSD into a
            RAM ring of ``prefetch + 1`` pages).
        storage: where the streamed weights live (default: ``"cpu"``): ``"cpu"``, one pinned host
            allocation of exactly their bytes; ``"nvme"``, a file under ``nvme_dir``, read ahead
            by the I/O engine (for inference: training needs ``"cpu"``).
        nvme_dir: with ``storage="nvme"`` (and only then): an existing directory on an SSD, a
            ``str``, ``os.PathLike`` or ``bytes`` path (default: None).
        checkpoint: a ``.safetensors`` file or an HF folder (sharded index or not) to load the
            weights from, into their storage, without materialising them: a model built with
            ``accelerate.init_empty_weights()`` then needs no RAM for a second copy (default:
            None, the model's own weights). Every file's header is checked first, by
            safetensors' own rules (each tensor's bytes within the file, exactly its size, no
            two overlapping): a malformed file is a ValueError naming it and the tensor.
        gpu_budget_gb: GiB of device memory for the offload (default: None, which streams every
            block: the slowest choice when most blocks would fit). Whole blocks stay resident as
            far as they fit after the ring, small blocks first, then layers in order; leave room
            for activations and the KV cache (``python -m offload_adam plan --inference`` sizes it).
            At most 1 PiB (``inf`` is refused).
        prefetch: blocks copied ahead of the one running (default: 2; 0: none). The ring has
            ``prefetch + 1`` slots, never more than the streamed blocks: a larger ``prefetch`` is
            capped at their number, with a warning.
        blocks: the modules to stream as blocks (default: None, each layer of a ModuleList of
            repeated layers, and each other module with parameters of its own).
        placement: where a block that is not resident on the GPU runs (default: ``"stream"``,
            copied to the GPU's ring and run there): ``"cpu"``, run on the CPU from its host
            copy (the hidden states cross instead of the weights; its layer's KV cache stays on
            the host); ``"auto"``, per call the cheaper of the two by the measured cost model
            (``python -m offload_adam calibrate``): decode steps on the CPU, long prompts
            streamed. Embeddings always look their rows up on the host; training always streams.
        host_budget_gb: with ``storage="nvme"``: GiB of RAM that keeps whole blocks (small blocks
            first, then layers) instead of reading them from the SSD each time (default: None,
            none); it must hold the RAM ring of pages read ahead. At most 1 PiB.
        num_threads: CPU threads of the blocks run on the CPU (default: None, torch's), so that a
            home server keeps cores for its other services; at most the CPUs this process may use
            (``os.sched_getaffinity``), more is refused.
        native_matmul: whether the blocks run on the CPU multiply their ``F.linear`` of at most
            ``hostmatmul.MAX_ROWS`` (16) rows, a decode step, with the native kernel
            (``weights/hostmatmul.py``) where it applies, no gradient wanted; torch's kernels
            otherwise. None (default): quantized weights (torchao's int8 or fp8 weight-only: torch's
            paths decode them 13-20x slower), and bfloat16 ones if the kernel's bfloat16 matmul beat
            torch's on this machine (``hostmatmul.bf16_faster``, measured once: ``report()``'s
            ``native_bf16``; a mixture of experts' bfloat16 routed experts: if the kernel's
            experts call beat torch's loop, ``experts.native_experts_faster``); True: bfloat16
            ones always too; False: torch's kernels always. The
            kernel sums in float32 and rounds once, as torch does, in another order: the logits
            agree with torch's path to the last bits, not necessarily bitwise.
        cost_model: ``placement="auto"``'s cost model (default: None, this machine's, measured
            once and cached: see ``offload_adam.weights.costs``).
        resident: a function of (name, parameter) returning a bool: the parameters it accepts
            are in no block, kept on the device for the whole offload as the buffers are
            (default: None, none): a LoRA adapter trained over a streamed frozen base
            (``resident=lambda n, p: p.requires_grad``). They must hold their values (not on the
            meta device), and ``placement`` must be ``"stream"``.
        quantize: quantize the weights as they load (default: None, as they are): a torchao
            config instance (``Int8WeightOnlyConfig()``, ``Float8WeightOnlyConfig()``: applied to
            each block by torchao's ``quantize_``), or a function called with each module of each
            block; a class, or anything else torchao does not take as a config, is a TypeError.
            With ``checkpoint``, each block is read in full precision and quantized before the
            next is read: the host never holds the full-precision model. Without, the model's
            full-precision tensors are kept until the offload is complete (a failure puts them
            back): the host holds them and the quantized copy at once. Quantized parameters
            (traceable tensor subclasses, as torchao's) are stored and streamed as their inner
            tensors, whether quantized here or before the call.

        plan: a :class:`~offload_adam.weights.plan.WeightPlan` from :func:`plan_weights`, maybe
            edited (a block's ``home``): built exactly, with the arguments it was made with (the
            others are then left at their defaults); one that does not fit its budgets, or made
            for another model, is refused naming the block, before anything changes (default:
            None, the plan these arguments make).

    Returns:
        The ``WeightOffload`` handle (``plan``, ``report()``, ``reset_stats()``, ``close()``; a
        context manager). Bad arguments are refused before anything changes. A failure after (an I/O
        error storing a block, a ``quantize=`` that raises, the device out of memory) puts the
        model back as it was, bitwise: every parameter (the same object under every name, so
        ties hold; a model filled from a checkpoint back on the meta device), buffer and module
        attribute; what the offload wrote under ``nvme_dir`` is removed, and the error raised.
    """
    given = {k: v for k, v in locals().items() if k not in ("model", "plan")}
    if plan is not None:
        if not isinstance(plan, WeightPlan):
            raise TypeError(f"plan must be a WeightPlan (offload_adam.plan_weights), got {type(plan).__name__}")
        changed = [k for k, v in given.items() if v is not _DEFAULTS[k] and v != _DEFAULTS[k]]
        if changed:
            raise ValueError(f"plan: it holds the arguments it was made with; {', '.join(changed)} given too (pass them to plan_weights)")
        plan.check()
        given = {**_DEFAULTS, **plan.args}
    return WeightOffload(model, _check_args(model, **given), plan)


def plan_weights(
    model: torch.nn.Module,
    device: Any = None,
    *,
    storage: str = "cpu",
    nvme_dir: Any = None,
    checkpoint: Any = None,
    gpu_budget_gb: float | None = None,
    prefetch: int = 2,
    blocks: list[torch.nn.Module] | None = None,
    placement: str = "stream",
    host_budget_gb: float | None = None,
    num_threads: int | None = None,
    cost_model: costs.CostModel | None = None,
    quantize: Any = None,
    native_matmul: bool | None = None,
    resident: Callable[[str, torch.nn.Parameter], bool] | None = None,
) -> WeightPlan:
    """What :func:`offload_weights` with these arguments would build, without building it: a
    :class:`~offload_adam.weights.plan.WeightPlan` (accelerate's ``infer_auto_device_map``) that
    lists each block (its name, bytes, where it lives: ``device``, ``ram`` or ``nvme``, and where
    it may run), the device ring, the RAM ring and the bytes per tier. ``print(plan)`` shows it
    as a table; ``plan.blocks[i].home`` may be edited (a streamed block made resident, a block
    kept in RAM) and the plan built with ``offload_weights(model, plan=plan)``.

    The model is left as it was (``quantize=`` quantizes it to know the blocks' bytes, and puts
    it back); the arguments are checked as :func:`offload_weights` checks them.

    For example::

        plan = offload_adam.plan_weights(model, gpu_budget_gb=6)
        print(plan)
        plan.blocks[-1].home = "device"      # the head resident too
        h = offload_adam.offload_weights(model, plan=plan)   # refused if it no longer fits

    Args:
        model: as for :func:`offload_weights`.
        device: as for :func:`offload_weights` (default: None).
        storage: as for :func:`offload_weights` (default: ``"cpu"``).
        nvme_dir: as for :func:`offload_weights` (checked, not written) (default: None).
        checkpoint: as for :func:`offload_weights` (its headers read; with ``quantize``, its blocks) (default: None).
        gpu_budget_gb: as for :func:`offload_weights` (default: None).
        prefetch: as for :func:`offload_weights` (default: 2).
        blocks: as for :func:`offload_weights` (default: None).
        placement: as for :func:`offload_weights` (default: ``"stream"``).
        host_budget_gb: as for :func:`offload_weights` (default: None).
        num_threads: as for :func:`offload_weights` (default: None).
        cost_model: as for :func:`offload_weights` (default: None).
        quantize: as for :func:`offload_weights` (default: None).
        native_matmul: as for :func:`offload_weights` (default: None).
        resident: as for :func:`offload_weights` (default: None).

    Returns:
        The ``WeightPlan``; it keeps these arguments (``plan.args``) for ``offload_weights(model, plan=plan)``.
    """
    a = _check_args(**locals())
    undo = Undo(model)
    try:
        found, _, routed = _prepare(model, a, undo)
        return _plan_of(model, found, a, routed)
    finally:
        undo.undo()


def _check_args(
    model: torch.nn.Module, device: Any, storage: str, nvme_dir: Any, checkpoint: Any, gpu_budget_gb: float | None,
    prefetch: int, blocks: list[torch.nn.Module] | None, placement: str, host_budget_gb: float | None,
    num_threads: int | None, cost_model: costs.CostModel | None, quantize: Any, native_matmul: bool | None,
    resident: Callable[[str, torch.nn.Parameter], bool] | None,
) -> _Args:  # fmt: skip
    """``offload_weights``' arguments checked (a clear error naming the argument, before
    anything changes), and the device resolved."""
    raw = {k: v for k, v in locals().items() if k != "model"}
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if storage == "nvme":
        if nvme_dir is None:
            raise ValueError('storage="nvme" needs nvme_dir: a directory on the SSD that holds the weights')
        nvme_dir = checks.directory(nvme_dir, "nvme_dir")
    elif nvme_dir is not None:
        raise ValueError(f'nvme_dir is only used with storage="nvme", got storage={storage!r}')
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if gpu_budget_gb is not None:
        gpu_budget_gb = checks.size(gpu_budget_gb, "gpu_budget_gb", optional=True)
    if blocks is not None and not isinstance(blocks, (list, tuple)):
        raise TypeError(f"blocks must be a list of modules, got {type(blocks).__name__}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if host_budget_gb is not None:
        host_budget_gb = checks.size(host_budget_gb, "host_budget_gb", optional=True)
        if storage != "nvme":
            raise ValueError(
                f'host_budget_gb is only used with storage="nvme" (the blocks kept in RAM instead of on the SSD), '
                f"got storage={storage!r}: with storage='cpu' every weight is in RAM"
            )
    if num_threads is not None:
        num_threads = checks.threads(num_threads, "num_threads")
    if native_matmul is not None and not isinstance(native_matmul, bool):
        raise TypeError(f"native_matmul must be None, True or False, got {type(native_matmul).__name__}")
    if cost_model is not None and not isinstance(cost_model, costs.CostModel):
        raise TypeError(f"cost_model must be an offload_adam.weights.costs.CostModel, got {type(cost_model).__name__}")
    _check_model(model, checkpoint)
    dev = _run_device(device)
    arguments.check(  # what this configuration would ignore: refused or warned, naming it (weights/arguments.py)
        on_host=isinstance(dev, HostDevice), storage=storage, gpu_budget_gb=gpu_budget_gb, placement=placement,
        cost_model=cost_model, native_matmul=native_matmul, prefetch=prefetch,
    )  # fmt: skip
    if checkpoint is not None:
        # Its type (a TypeError naming checkpoint) and every file's header, checked before anything
        # changes: tie_weights() and quantize= act on the model before the offload reads it.
        Checkpoint(checkpoint).close()
    keep = _kept(model, resident, placement) if resident is not None else frozenset()
    quantize_fn = quantizer(quantize) if quantize is not None else None
    return _Args(
        dev, storage, nvme_dir, checkpoint, gpu_budget_gb, prefetch, list(blocks) if blocks is not None else None,
        placement, host_budget_gb, num_threads, cost_model, quantize_fn, native_matmul, keep, raw,
    )  # fmt: skip


def _kept(model: torch.nn.Module, resident: Any, placement: str) -> frozenset[int]:
    """The parameters ``resident`` keeps on the device (by ``id``), checked."""
    if not callable(resident):
        raise TypeError(f"resident must be a function of (name, parameter), got {type(resident).__name__}")
    kept = []
    for n, p in model.named_parameters():
        answer = resident(n, p)
        if not isinstance(answer, bool):  # (a truthy string would keep every parameter)
            got = f"a {type(answer).__name__}" if isinstance(answer, Tensor) else f"{answer!r} (of type {type(answer).__name__})"
            raise TypeError(f"resident must return a bool, got {got} for {n}")
        if answer:
            kept.append((n, p))
    quantized = [(n, p) for n, p in kept if wrapped(p)]
    if quantized:
        n, p = quantized[0]
        raise ValueError(
            f"resident: {n} is a {type(p).__name__} (a quantized tensor): parameters kept on the device are moved "
            "there as plain tensors of its dtype (a dequantized copy, or torchao's copy_ refusing it); leave it out "
            "of resident= and it streams with its block"
        )
    on_meta = [n for n, p in kept if p.device.type == "meta"]
    if on_meta:
        raise ValueError(f"resident: {on_meta[0]} is on the meta device: parameters kept on the device are moved there as they are")
    if kept and placement != "stream":
        raise ValueError(f"resident: parameters kept on the device need placement='stream' (a block run on the CPU reads them), got {placement!r}")
    return frozenset(id(p) for _, p in kept)


def _run_device(device: Any) -> Device:
    """The device the model runs on: ``device``; by default the simulated device installed in
    the tests (a device of its own), else the current GPU, else the CPU (:data:`~offload_adam.runtime.device.HOST`)."""
    if device is None and default_device() is None:
        return HOST
    if device is not None and torch.device(device).type == "cpu" and device_for(torch.device("cpu")) is None:
        return HOST
    return stream_device(device, "offload_weights streams weights to a GPU")
