"""``offload_weights``: a model's weights kept on the host (pinned RAM or NVMe) and streamed to
the device block by block, ahead of need (see ``streamer.py``), with whole blocks resident on
the device as far as ``gpu_budget_gb`` allows."""

from __future__ import annotations

import errno
import itertools
import logging
import resource
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..runtime import checks, costs
from ..runtime.device import HOST, Device, HostDevice, Meter, default_device, device_for, set_data, stream_device, swap
from ..runtime.hosted import Home, claimed, set_home, wait_for_writer
from ..runtime.pages import ALIGN
from ..runtime.pinned import PinnedArena, align_up, trim_host_memory
from . import arguments, progress, summary
from .blocks import Block, Entry, find_blocks, wrapped
from .checkpoint import Checkpoint
from .loader import placeholders
from .placement import PLACEMENTS, HostCalls, Placer, host_only_blocks
from .quantize import Quantizer, quantize_blocks, quantizer
from .ring import plan as ring_plan
from .storage import HostWeights, NvmeWeights, SplitWeights
from .streamer import Streamer
from .undo import Undo, from_copy

GiB = 1 << 30
DEFAULT_PREFETCH = 2  # offload_weights' default: capped without a word when fewer blocks stream
STORAGES = ("cpu", "nvme")
ATTR = "_offload_adam_weights"  # the model keeps its handle (and so the streamer) alive
log = logging.getLogger("offload_adam")


def ring_bytes(blocks: Sequence[Block], streamed: Sequence[int], own: set[int], prefetch: int, host_only: set[int] | None = None) -> int:
    """Device bytes of the streaming ring for ``streamed`` blocks (see ``ring.py``); the slots of
    ``host_only`` blocks (embeddings looked up on the host) are never made."""
    size, n, made, later = ring_plan(list(blocks), list(streamed), own, prefetch, host_only=host_only)
    skip = host_only or set()
    return n * size + sum(blocks[b].nbytes for b in made | later if b not in skip)


def staging_slots(prefetch: int, blocks: int, on_device: bool) -> int:
    """Slots of the RAM ring NVMe pages are read into: a page being copied to the device (or run
    by the CPU) and ``prefetch`` read ahead, and never more than the ``blocks`` it serves (on a
    device, one more: a block's page still being copied while it is read again for the next pass)."""
    return max(1, min(prefetch + (2 if on_device else 1), blocks + (1 if on_device else 0)))


def own_slot_blocks(blocks: Sequence[Block]) -> set[int]:
    """Blocks that need a slot of their own: run by several modules (tied parameters), or
    holding parameters of a module that runs other blocks (they stay needed meanwhile)."""
    triggers = {id(m): b.index for b in blocks for m in b.modules}
    own = set()
    for b in blocks:
        if b.shared:
            own.add(b.index)
            continue
        if not b.layer:
            for m in b.modules:
                if any(id(c) in triggers and triggers[id(c)] != b.index for c in m.modules()):
                    own.add(b.index)
    return own


def choose_resident(
    blocks: Sequence[Block], budget: int | None, prefetch: int, buffers: int,
    ring: Callable[[list[int]], int] | None = None, what: str = "gpu_budget_gb", among: Sequence[int] | None = None,
) -> set[int]:  # fmt: skip
    """The blocks kept resident within ``budget`` bytes (None: none), after the ring: small
    blocks first (not layers, by size), then layers in order. Raises if the ring alone (with
    the buffers, always resident) does not fit. ``ring``: the ring's bytes for the blocks left
    streamed (default: the device's, see ``ring.py``); ``what`` names the budget in the error;
    ``among``: the blocks that may be kept (default: all)."""
    own = own_slot_blocks(blocks)
    every = [b.index for b in blocks] if among is None else list(among)
    if budget is None:
        return set()
    ring_of = ring or (lambda streamed: ring_bytes(blocks, streamed, own, prefetch))

    def cost(res: set[int]) -> int:
        streamed = [i for i in every if i not in res]
        return buffers + sum(blocks[i].nbytes for i in res) + ring_of(streamed)

    if cost(set()) > budget:
        raise ValueError(
            f"{what}: {budget / GiB:.4g} GiB is smaller than the streaming ring with prefetch={prefetch} "
            f"({cost(set()) / GiB:.4g} GiB, buffers included)"
        )
    order = sorted((i for i in every if not blocks[i].layer), key=lambda i: blocks[i].nbytes) + [i for i in every if blocks[i].layer]
    res: set[int] = set()
    for i in order:
        if cost(res | {i}) <= budget:
            res.add(i)
    return res


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


def _to_meta(e: Entry) -> None:
    """``e``'s parameter (the same object, for every module holding it) onto the meta device: its
    weights are lost, and a read of it fails loudly."""
    swap(e.param, e.rebuild([torch.empty(q.shape, dtype=q.dtype, device="meta") for q in e.parts]))


class WeightOffload:
    """The handle :func:`offload_weights` returns: ``report()``, ``reset_stats()``, ``close()``."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: Device,
        *,
        storage: str,
        nvme_dir: Any,
        checkpoint: Any,
        gpu_budget_gb: float | None,
        prefetch: int,
        blocks: list[torch.nn.Module] | None,
        placement: str = "stream",
        host_budget_gb: float | None = None,
        num_threads: int | None = None,
        cost_model: costs.CostModel | None = None,
        quantize: Quantizer | None = None,
        native_matmul: bool | None = None,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.device = device
        self.storage = storage
        self.placement = placement if not isinstance(device, HostDevice) else "cpu"
        on_device = not isinstance(device, HostDevice)
        with Undo(model) as undo:  # (a failure puts the model back as it was: see undo.py)
            tie = getattr(model, "tie_weights", None)
            if checkpoint is not None and callable(tie):
                # As accelerate's load_checkpoint_and_dispatch: an empty model (init_empty_weights)
                # may come untied, and save_pretrained writes a tied parameter under one name only.
                tie()
            if quantize is not None:
                quantize_blocks(model, blocks, checkpoint, quantize, keep, undo)
                checkpoint = None  # (read: the model is on the host now, quantized)
            self.blocks = find_blocks(model, blocks, keep)
            # resident=: parameters in no block, on the device for the whole offload (as buffers)
            self.kept = [p for p in model.parameters() if id(p) in keep]
            self.meter = Meter()
            self.arena = PinnedArena(device)
            buffers = [(m, name, buf) for m in model.modules() for name, buf in m._buffers.items() if buf is not None]
            buffer_bytes = sum(b.numel() * b.element_size() for _, _, b in buffers) + sum(p.numel() * p.element_size() for p in self.kept)
            own = own_slot_blocks(self.blocks)
            host_only = host_only_blocks(self.blocks)
            every = [b.index for b in self.blocks]
            page = lambda streamed: max((align_up(self.blocks[i].nbytes, ALIGN) for i in streamed), default=0)  # noqa: E731
            host_budget = None if host_budget_gb is None else int(host_budget_gb * GiB)
            if on_device:
                # Whole blocks on the device within gpu_budget_gb, after the ring (placement "cpu"
                # makes no general slots: a call that must stream makes its slot then).
                general = self.placement != "cpu"

                def device_ring(streamed: list[int]) -> int:
                    size, n, made, later = ring_plan(self.blocks, streamed, own, prefetch, general, host_only)
                    return n * size + sum(self.blocks[i].nbytes for i in made | later if i not in host_only)

                budget = None if gpu_budget_gb is None else int(gpu_budget_gb * GiB)
                self.resident = choose_resident(self.blocks, budget, prefetch, buffer_bytes, ring=device_ring)
            elif storage == "cpu":
                self.resident = set(every)  # the host is the device: every block in RAM, nothing to stream
            else:
                # The CPU runs the model: whole blocks in RAM within host_budget_gb, after the RAM ring
                # of prefetch + 1 pages the others are read into (None: none in RAM).
                self.resident = choose_resident(
                    self.blocks, host_budget, prefetch, buffer_bytes, what="host_budget_gb",
                    ring=lambda streamed: staging_slots(prefetch, len(streamed), False) * page(streamed),
                )  # fmt: skip
            streamed = [b.index for b in self.blocks if b.index not in self.resident]
            self.streamed = streamed
            if prefetch > len(streamed):
                # More blocks ahead than there are to read: the rings never hold more than the
                # streamed blocks (prefetch=10**9 would allocate slots until memory ran out). Where
                # nothing streams (every block resident) there is no ring, and nothing to say.
                if prefetch > DEFAULT_PREFETCH and streamed:
                    warnings.warn(
                        f"offload_weights: prefetch={prefetch} is more than the {len(streamed)} streamed block"
                        f"{'s' if len(streamed) != 1 else ''}; capped at {len(streamed)}",
                        stacklevel=3,
                    )
                prefetch = len(streamed)
            self.in_ram: set[int] = set()  # streamed blocks host_budget_gb keeps in RAM (a GPU, storage="nvme")
            if on_device and storage == "nvme" and host_budget is not None:
                self.in_ram = choose_resident(
                    self.blocks, host_budget, prefetch, 0, what="host_budget_gb", among=streamed,
                    ring=lambda rest: staging_slots(prefetch, len(rest), True) * page(rest),
                )  # fmt: skip
            ck = Checkpoint(checkpoint) if checkpoint is not None else None
            where = ck.locate(self.blocks, set(model.state_dict(keep_vars=True))) if ck is not None else None
            stream_blocks = [self.blocks[i] for i in streamed]
            if storage == "nvme" and self.in_ram:
                on_disk = [b for b in stream_blocks if b.index not in self.in_ram]
                self.source: HostWeights | NvmeWeights | SplitWeights = SplitWeights(
                    HostWeights(self.arena, [b for b in stream_blocks if b.index in self.in_ram]),
                    NvmeWeights(device, self.arena, nvme_dir, on_disk, staging_slots(prefetch, len(on_disk), on_device)),
                    self.in_ram,
                )
            elif storage == "nvme":
                slots = staging_slots(prefetch, len(stream_blocks), on_device)
                self.source = NvmeWeights(device, self.arena, nvme_dir, stream_blocks, slots)
            else:
                self.source = HostWeights(self.arena, stream_blocks)
            undo.add(self.source.close)
            self.placeholders = placeholders(device, [self.blocks[i] for i in streamed], self.meter)
            try:
                self._fill(ck, where, buffers, undo)
                self.source.pin()
            finally:
                if ck is not None:
                    ck.close()
            triggers = {id(m): b.index for b in self.blocks for m in b.modules}
            guess = [triggers[id(m)] for m in model.modules() if id(m) in triggers]
            # Each streamed parameter's home: its host copy, which an optimizer's step writes (the
            # next forward streams it from there); NVMe keeps none in memory.
            self.homes: dict[int, list[Home]] = {}
            undo.add(self._unset_homes)  # (undone before the fill: a parameter with a home, a weak reference, cannot be swapped back)
            for i in streamed:
                b = self.blocks[i]
                host = self.source.view(b) if isinstance(self.source, (HostWeights, SplitWeights)) else None
                self.homes[i] = [Home(e.view(host) if host is not None and not e.wrapped else None, device, b.name) for e in b.entries]
                for e, h in zip(b.entries, self.homes[i]):
                    set_home(e.param, h)
            # placement="auto": the cost model, and where its figures came from (report(), the log)
            self.cost_model: dict[str, str] | None = None
            if self.placement == "auto":
                dtype = next((e.param.dtype for b in self.blocks for e in b.entries), torch.bfloat16)
                if cost_model is None:
                    cost_model = costs.cached_model(dtype)
                self.cost_model = cost_model.describe(dtype)
                log.info("offload_adam: placement='auto' costs calls with %s", "; ".join(f"{k} {v}" for k, v in self.cost_model.items()))
            self.placer = Placer(self.placement, self.blocks, cost_model, on_device)
            self.streamer = Streamer(
                device, self.blocks, streamed, own, self.source, prefetch, self.meter, guess, self.placeholders, self.homes,
                placer=self.placer,
            )  # fmt: skip
            undo.add(self.streamer.close)
            # The hooks of calls run on the CPU (tensors across, KV cache, threads, time): every
            # streamed block's modules that may run there, and with the CPU as the device every block's.
            # A streamed embedding is looked up on the host under every placement (its rows cross, not
            # its table): its block's modules get the hooks too.
            self.host_calls: HostCalls | None = None
            looked_up = {i for i in self.streamed if any(isinstance(m, torch.nn.Embedding) for m in self.blocks[i].modules)}
            if self.placement != "stream" or num_threads is not None or (on_device and looked_up):
                cpu_runs = self.placement != "stream" or not on_device  # blocks other than lookups run on the CPU
                self.host_calls = HostCalls(device, self.blocks, self.streamer.decided, num_threads, native_matmul if cpu_runs else False)
                undo.add(self.host_calls.close)
                for b in self.blocks:
                    if (b.index in self.streamed and (cpu_runs or b.index in looked_up)) or not on_device:
                        for m in b.modules:
                            self.host_calls.attach(m, b.index)
            self.prefetch = prefetch
            self.num_threads = num_threads
            self.native_matmul = native_matmul
            self.closed = False
            setattr(model, ATTR, self)

    def _fill(self, ck: Checkpoint | None, where: Any, buffers: list[tuple[torch.nn.Module, str, Tensor]], undo: Undo) -> None:
        """Every block's bytes into their storage (streamed) or device memory (resident), from
        the model's own tensors or the checkpoint, block by block, its parameters then pointed
        at their placeholders or device copies; ``undo`` records how to put each back (see
        ``undo.py``). A block copied into host memory (the pinned copy, blocks kept in RAM, the
        CPU as the device) lets its own tensors go at once, and the storage's memory is touched
        only as it is filled (pinned after), so the host holds the model at most once, plus a
        block; the others' tensors are kept until the offload is complete (the host holds them
        anyway: they go to NVMe or the GPU)."""
        dev = self.device
        for b in progress.blocks(self.blocks, len(self.blocks), "offload_weights: filling blocks"):  # (a bar on a terminal, past 3 s)
            resident = b.index in self.resident
            dst = torch.empty(b.nbytes, dtype=torch.uint8) if resident else self.source.staging(b)
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
                self.source.store_block(b)
                if isinstance(self.source, (HostWeights, SplitWeights)):
                    host = self.source.view(b)
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
        torch's: see ``native_matmul``; ``native_bf16``: whether bf16 weights go to it), and with
        ``storage="nvme"`` ``read_bytes`` and ``io_wait_s`` (host time waiting for the disk); and
        the host's state now: ``host_rss_peak_bytes`` (the process's peak resident memory) and
        ``page_cache_bytes`` (of this offload's own files: ``O_DIRECT`` keeps it near 0); with
        ``placement="auto"``, ``cost_model``: each figure its choices take and where it came from
        (``runtime/costs.py``; None otherwise)."""
        st = self.streamer
        h2d_s, stall_s = st.timings()
        on_device = not isinstance(self.device, HostDevice)
        resident = sum(self.blocks[i].nbytes for i in self.resident) + sum(
            t.numel() * t.element_size() for t in [*self.model.buffers(), *self.kept]
        )
        nvme = self.source.nvme if isinstance(self.source, SplitWeights) else self.source
        hc = (
            self.host_calls.report()
            if self.host_calls is not None
            else {"cpu_s": 0.0, "hidden_bytes": 0, "kv_bytes": 0, "native_calls": 0, "torch_calls": 0, "native_bf16": False}
        )
        out: dict[str, Any] = {
            "device": str(self.device.torch_device) if on_device else "cpu",
            "placement": self.placement,
            "cost_model": self.cost_model,
            "gpu_peak_bytes": self.meter.peak if on_device else 0,
            "gpu_resident_bytes": resident if on_device else 0,
            "ring_bytes": st.ring_bytes,
            "host_pinned_bytes": self.arena.nbytes if on_device else 0,
            "host_resident_bytes": (resident if not on_device else 0) + sum(self.blocks[i].nbytes for i in self.in_ram),
            "host_ring_bytes": nvme.ring.nbytes if isinstance(nvme, NvmeWeights) else 0,
            "nvme_bytes": self.source.nvme_bytes,
            "weights_bytes": sum(b.nbytes for b in self.blocks),
            "streamed_bytes": sum(self.blocks[i].nbytes for i in self.streamed),
            "h2d_bytes": st.stats["h2d_bytes"],
            "h2d_s": h2d_s,
            "stall_s": stall_s,
            "passes": max(st.stats["passes"], self.placer.forwards()),  # (the streamer counts training's cycles only)
            "loads": st.stats["loads"],
            "on_demand_loads": st.stats["on_demand"],
            "calls": {ph: dict(c) for ph, c in self.placer.counts.items()},
            **hc,
            "host_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "page_cache_bytes": nvme.store.page_cache_bytes() if isinstance(nvme, NvmeWeights) else 0,
            "blocks": len(self.blocks),
            "streamed_blocks": len(self.streamed),
            "prefetch": self.prefetch,
            "storage": self.storage,
        }
        out.update(self.source.io_stats())
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
        self.streamer.reset_stats()
        self.placer.reset_stats()
        if self.host_calls is not None:
            self.host_calls.reset_stats()
        if isinstance(self.source, (NvmeWeights, SplitWeights)):
            self.source.stats.reset()

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
            # Every stream, the user's included, before the ring is freed: a forward under
            # torch.cuda.stream(s) may still read it, and memory freed first could go to another
            # thread's allocation meanwhile (a cold path: one synchronize).
            self.device.synchronize()
            self.streamer.close()
            for b in self.blocks:
                if b.index in self.resident:
                    for e in b.entries:
                        e.attach([self._to_host(t) for t in e.tensors()])
                    continue
                try:
                    data = self.source.read(b)
                except OSError as err:
                    lost.append((b.name, err))
                    for e in b.entries:
                        _to_meta(e)
                    continue
                for e in b.entries:
                    e.attach([v.clone() for v in e.views(data)])
            for m in self.model.modules():
                for name, buf in m._buffers.items():
                    if buf is not None:
                        m._buffers[name] = self._to_host(buf)
            for p in self.kept:
                set_data(p, self._to_host(p.detach()))
        finally:
            try:
                self.source.close()
            finally:
                self.streamer.loader.placeholders = self.placeholders = {}
                if getattr(self.model, ATTR, None) is self:
                    delattr(self.model, ATTR)
        if lost:
            names = [n for b in self.blocks for e in b.entries if e.param.device.type == "meta" for n in e.names[:1]]
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
            ``native_bf16``); True: bfloat16 ones always too; False: torch's kernels always. The
            kernel sums in float32 and rounds once, as torch does, in another order: the logits
            agree with torch's path to the last bits, not necessarily bitwise.
        cost_model: ``placement="auto"``'s cost model (default: None, this machine's, measured
            once and cached: see ``offload_adam.runtime.costs``).
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

    Returns:
        The ``WeightOffload`` handle (``report()``, ``reset_stats()``, ``close()``; a context
        manager). Bad arguments are refused before anything changes. A failure after (an I/O
        error storing a block, a ``quantize=`` that raises, the device out of memory) puts the
        model back as it was, bitwise: every parameter (the same object under every name, so
        ties hold; a model filled from a checkpoint back on the meta device), buffer and module
        attribute; what the offload wrote under ``nvme_dir`` is removed, and the error raised.
    """
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
        raise TypeError(f"cost_model must be an offload_adam.runtime.costs.CostModel, got {type(cost_model).__name__}")
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
    keep: frozenset[int] = frozenset()
    if resident is not None:
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
        keep = frozenset(id(p) for _, p in kept)
    quantize_fn = quantizer(quantize) if quantize is not None else None
    return WeightOffload(
        model, dev, storage=storage, nvme_dir=nvme_dir, checkpoint=checkpoint, gpu_budget_gb=gpu_budget_gb,
        prefetch=prefetch, blocks=list(blocks) if blocks is not None else None, placement=placement,
        host_budget_gb=host_budget_gb, num_threads=num_threads, cost_model=cost_model, quantize=quantize_fn,
        native_matmul=native_matmul, keep=keep,
    )  # fmt: skip


def _run_device(device: Any) -> Device:
    """The device the model runs on: ``device``; by default the simulated device installed in
    the tests (a device of its own), else the current GPU, else the CPU (:data:`~offload_adam.runtime.device.HOST`)."""
    if device is None and default_device() is None:
        return HOST
    if device is not None and torch.device(device).type == "cpu" and device_for(torch.device("cpu")) is None:
        return HOST
    return stream_device(device, "offload_weights streams weights to a GPU")
