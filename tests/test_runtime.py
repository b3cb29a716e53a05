"""The offload runtime, on its own (it knows nothing of optimizers or weights): one device per
torch device, the pinned arena, the pager, the module schedule."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from offload_adam import testing
from offload_adam.runtime.device import device_for
from offload_adam.runtime.pager import Family, Pager
from offload_adam.runtime.pages import PageStore, aligned_empty
from offload_adam.runtime.pinned import PinnedArena
from offload_adam.runtime.schedule import SCHEDULE

# -- devices ------------------------------------------------------------------------------------


def test_cpu_tensors_have_no_device_unless_one_is_installed() -> None:
    assert device_for(torch.device("cpu")) is None
    with testing.simulated_device(max_delay_s=0.0) as sim:
        assert device_for(sim.torch_device) is sim and device_for(torch.device("cpu")) is None
    assert device_for(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="meta: not supported"):
        device_for(torch.device("meta"))


@pytest.mark.cuda
def test_one_cuda_device_per_torch_device() -> None:
    a, b = device_for(torch.device("cuda")), device_for(torch.device("cuda", torch.cuda.current_device()))
    assert a is b and a is not None and a.h2d is b.h2d


def test_autocast_on_the_simulated_device_casts_as_cudas() -> None:
    """torch.autocast("simgpu") (issue 32): CUDA's lists, above autograd. A GEMM and attention run
    in the autocast dtype, a norm, a softmax and a loss in float32, other operations in their
    inputs' dtype, CPU tensors untouched; the backward (outside autocast) gives float32 gradients
    on the device. The cast cache as CUDA's: a parameter's cast is kept until the outermost
    autocast exits (a parameter whose memory is swapped under the same object gets its previous
    cast), unless the cache is off."""
    F = torch.nn.functional
    with testing.simulated_device(max_delay_s=0.0) as sim:
        d = sim.torch_device
        lin, norm = torch.nn.Linear(8, 8).to(d), torch.nn.LayerNorm(8).to(d)
        x = torch.randn(2, 8).to(d)
        with torch.autocast(d.type, dtype=torch.bfloat16):
            y = lin(x)
            q = y.view(1, 2, 1, 8)
            assert y.dtype == F.scaled_dot_product_attention(q, q, q).dtype == (y + 1).dtype == torch.bfloat16
            assert norm(y).dtype == torch.softmax(y, -1).dtype == torch.float32
            loss = F.cross_entropy(y, torch.tensor([1, 2]).to(d))
            assert loss.dtype == torch.float32
            assert torch.mm(torch.eye(2), torch.eye(2)).dtype == torch.float32  # the CPU's
        loss.backward()
        assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32 and lin.weight.grad.device == d

        w, e = torch.nn.Parameter(torch.ones(4, 4).to(d)), torch.eye(4).to(d)
        for cache, want in ((True, 1.0), (False, 3.0)):
            with torch.autocast(d.type, dtype=torch.bfloat16, cache_enabled=cache):
                torch.mm(e, w)
                with torch.no_grad():
                    w.data = torch.full((4, 4), want if not cache else 3.0).to(d)
                assert torch.mm(e, w)[0, 0].item() == want
        with torch.autocast(d.type, dtype=torch.bfloat16):  # a new region: a new cast
            assert torch.mm(e, w)[0, 0].item() == 3.0
    assert sim.violations == []


def test_moving_a_module_to_the_simulated_device_keeps_its_parameters_and_their_ties() -> None:
    """``module.to("cuda")`` keeps each parameter object (torch sets its data in place), so a tied
    embedding and head stay one parameter; the simulated device's ``.to()`` keeps them too (it
    made a new parameter per module, and a tied model trained two copies of the tied weight)."""
    with testing.simulated_device(max_delay_s=0.0) as sim:
        emb, head = torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False)
        head.weight = emb.weight
        m, w = torch.nn.ModuleDict({"emb": emb, "head": head}), emb.weight
        m.to(sim.torch_device)
        assert m.emb.weight is w and m.head.weight is w and w.device == sim.torch_device
        assert isinstance(w, torch.nn.Parameter) and len(list(m.parameters())) == 1


@pytest.mark.parametrize("fn", [torch.nn.functional.silu, torch.nn.functional.mish], ids=["silu", "mish"])
def test_the_simulated_device_computes_a_backward_as_the_cpu(fn: Any) -> None:
    """A backward on the simulated device is bitwise the CPU's, as its forward is: silu's and
    mish's run the CPU's kernels (``silu_backward``), not the composite decomposition torch takes
    for a device type without kernels of its own (sigmoid and products: other bits)."""
    x, g = torch.randn(64, 33), torch.randn(64, 33)
    xc = x.clone().requires_grad_()
    fn(xc).backward(g)
    with testing.simulated_device(max_delay_s=0.0) as sim:
        xd = x.to(sim.torch_device).requires_grad_()
        fn(xd).backward(g.to(sim.torch_device))
        assert xd.grad is not None and xd.grad.device == sim.torch_device
        assert torch.equal(xd.grad.cpu(), xc.grad)


def test_a_tensor_of_the_simulated_device_reads_back_as_on_cuda() -> None:
    """``.tolist()`` and ``.item()`` copy to the host, as a CUDA tensor's do (torch refuses
    ``tolist`` for a subclass: examples/train_gpt.py --simulate failed reading its answers)."""
    with testing.simulated_device(max_delay_s=0.0) as sim:
        t = torch.arange(6).view(2, 3).to(sim.torch_device)
        assert t.tolist() == [[0, 1, 2], [3, 4, 5]] and t[1, 2].item() == 5


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_a_backward_that_raises_on_the_simulated_device_raises_its_error(how: str) -> None:
    """A hook that raises inside a backward on the simulated device: the caller gets that error,
    as on "cuda" (torch aborted the process: the engine's stream guard called the Python device
    guard while the error was still set), and the next backward runs."""
    with testing.simulated_device(max_delay_s=0.0) as sim:
        w = torch.nn.Parameter(torch.ones(4, 4, device=sim.torch_device))

        def boom(_: torch.Tensor) -> None:
            raise MemoryError("out of memory (test)")

        hook = w.register_hook(boom)
        with pytest.raises(MemoryError, match="out of memory"):
            if how == "grad":
                torch.autograd.grad((w * 2).sum(), [w])
            else:
                (w * 2).sum().backward()
        hook.remove()
        (w * 3).sum().backward()
        assert w.grad is not None and w.grad.device == sim.torch_device and w.grad.cpu().eq(3).all()


def test_autograd_backward_of_several_tensors_on_the_simulated_device_reaches_each() -> None:
    """``torch.autograd.backward([a, b], [ga, gb])`` gives every tensor its gradient, as on
    "cuda" (the simulated device took the first tensor of the list only)."""
    with testing.simulated_device(max_delay_s=0.0) as sim:
        ps = [torch.nn.Parameter(torch.zeros(3, device=sim.torch_device)) for _ in range(3)]
        gs = [torch.full((3,), float(k + 1), device=sim.torch_device) for k in range(3)]
        torch.autograd.backward([p * 1 for p in ps], gs)
        torch.autograd.backward(ps[0] * 2, gs[0])  # one tensor, accumulated
        assert [p.grad.cpu().tolist() for p in ps] == [[3.0] * 3, [2.0] * 3, [3.0] * 3]  # type: ignore[union-attr]


# -- the pinned arena ---------------------------------------------------------------------------


@pytest.mark.parametrize("align", [64, 4096])
def test_the_arena_allocates_exactly_what_is_asked_and_counts_it(align: int) -> None:
    with testing.simulated_device(max_delay_s=0.0) as sim:
        arena = PinnedArena(sim)
        n = 3 * 1000 + 7  # far from a power of two
        t = arena.alloc(n, torch.bfloat16, align=align)
        assert t.numel() == n and t.dtype == torch.bfloat16 and t.data_ptr() % align == 0
        assert bool((t == 0).all())
        slack = align if align > 64 else 0
        assert n * 2 <= arena.nbytes <= n * 2 + slack
        view = t[10:20]
        del t
        gc.collect()
        assert arena.nbytes > 0  # a view keeps the allocation
        del view
        gc.collect()
        assert arena.nbytes == 0


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _thp_eligible(addr: int) -> bool:
    """``THPeligible`` of the mapping of this process holding ``addr`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, b = (int(v, 16) for v in head.split("-"))
                inside = a <= addr < b
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(_thp_mode() != "madvise", reason="transparent huge pages not in madvise mode here")
def test_the_host_copy_of_the_weights_asks_for_huge_pages() -> None:
    """An allocation to fill (pin=False: the offload's host copies of the weights, dense and
    routed experts) asks for transparent huge pages before it is written; in madvise mode a
    mapping is eligible only where asked."""
    from offload_adam.runtime.device import HostDevice

    t = PinnedArena(HostDevice()).alloc(16 << 20, torch.uint8, pin=False)
    inner = -(-t.data_ptr() // (2 << 20)) * (2 << 20)  # (the first whole huge page inside)
    assert _thp_eligible(inner)
    plain = torch.empty(16 << 20, dtype=torch.uint8)
    assert not _thp_eligible(-(-plain.data_ptr() // (2 << 20)) * (2 << 20))  # (what it would be without)


def test_an_allocation_is_released_only_after_the_copies_queued_on_it() -> None:
    """The simulator's release models cudaHostUnregister under a DMA: with the release waiting
    for the streams (as the CUDA device's finalizer does) no copy touches released memory."""
    with testing.simulated_device(max_delay_s=0.01) as sim:
        arena = PinnedArena(sim)
        src = arena.alloc(1000, torch.float32)
        src.fill_(3.0)
        dst = torch.zeros(1000, device=sim.torch_device)
        sim.stream_waits(sim.h2d, sim.record_current())  # after the compute that zeroed it
        sim.copy([(dst, src)], sim.h2d)
        del src
        gc.collect()
        sim.drain()
        assert sim.violations == [] and bool((dst == 3.0).all())


# -- the simulator's checks, each shown catching a deliberately broken wait ------------------------


@pytest.mark.parametrize("wait", [True, False])
def test_the_simulator_sees_a_copy_into_memory_compute_may_still_read(wait: bool) -> None:
    """Happens-before: the compute runs on the host, so it has always finished when the next copy
    is queued; the simulator still flags a copy that overwrites memory an earlier compute
    operation read, unless the copy's stream waited an event recorded after that operation."""
    with testing.simulated_device(max_delay_s=0.0) as sim:
        slot = sim.empty(64, torch.float32)
        sim.stream_waits(sim.h2d, sim.record_current())
        sim.copy([(slot, PinnedArena(sim).alloc(64, torch.float32))], sim.h2d)
        sim.current_waits(sim.record(sim.h2d))
        (slot * 2).sum()  # the compute reads the slot
        if wait:
            sim.stream_waits(sim.h2d, sim.record_current())
        sim.copy([(slot, PinnedArena(sim).alloc(64, torch.float32))], sim.h2d)
        sim.drain()
    assert (sim.violations == []) == wait, sim.violations
    if not wait:
        assert "writes bytes 0-256 of device memory of 256 bytes" in sim.violations[0]
        assert "last used by mul.Tensor (epoch" in sim.violations[0]


@pytest.mark.parametrize("wait", [True, False])
def test_a_write_from_another_stream_must_follow_the_allocation(wait: bool) -> None:
    """Allocation-time reuse (issue 32, point 2): memory the caching allocator hands out keeps its
    previous owner's pending accesses, and the allocation is a write of the allocating stream: a
    copy into it from a side stream must follow an event of that stream recorded after the
    allocation. Here the memory of a tensor the compute just read is handed out again at once;
    the copy that does not wait for the compute lands while (on a GPU) the read may still run."""
    with testing.simulated_device(max_delay_s=0.0) as sim:
        old = sim.empty(256, torch.float32)
        old.fill_(1.0)
        old.sum()  # the compute reads it (queued, on a GPU), then frees it
        del old
        buf = sim.empty(256, torch.float32)  # the same memory, at once
        assert sim.counters()["reuses"] == 1
        if wait:
            sim.stream_waits(sim.h2d, sim.record_current())
        sim.copy([(buf, PinnedArena(sim).alloc(256, torch.float32))], sim.h2d)
        sim.drain()
    assert (sim.violations == []) == wait, sim.violations
    if not wait:
        assert "last used by the allocation (epoch" in sim.violations[0] and "h2d copy" in sim.violations[0]


@pytest.mark.parametrize("keep", [True, False])
def test_the_simulator_reuses_freed_memory_at_once_unless_held_for_another_stream(keep: bool) -> None:
    """The caching allocator: memory freed goes to the next allocation of its stream at once;
    a copy still writing it must have been declared (keep_until_done, record_stream)."""
    with testing.simulated_device(max_delay_s=0.05) as sim:
        buf = sim.empty(1024, torch.uint8)
        src = PinnedArena(sim).alloc(1024, torch.uint8)  # (kept: its release would drain the streams)
        sim.stream_waits(sim.h2d, sim.record_current())  # (after the allocation)
        sim.copy([(buf, src)], sim.h2d)
        if keep:
            sim.keep_until_done(buf, sim.h2d)
        del buf
        again = sim.empty(1024, torch.uint8)  # the next allocation of the compute stream
        assert bool((again == 0xA5).all())  # poisoned, whatever it held
        sim.drain()
    assert (sim.violations == []) == keep, sim.violations
    assert (sim.counters()["reuses"] == 1) != keep  # held: a fresh block instead


@pytest.mark.parametrize("source", ["pinned", "pageable", "pageable-blocking"])
def test_the_simulator_flags_an_asynchronous_copy_from_pageable_memory(source: str) -> None:
    with testing.simulated_device(max_delay_s=0.0) as sim:
        dst = sim.empty(256, torch.float32)
        src = PinnedArena(sim).alloc(256, torch.float32) if source == "pinned" else torch.ones(256)
        sim.stream_waits(sim.h2d, sim.record_current())
        if source == "pageable-blocking":
            sim.copy_blocking([(dst, src)], sim.h2d)
        else:
            sim.copy([(dst, src)], sim.h2d)
        sim.drain()
    assert sim.counters()["pageable_copies"] == (source == "pageable")
    assert (sim.violations == []) == (source != "pageable"), sim.violations


@pytest.mark.parametrize("guarded", [True, False])
def test_the_simulator_sees_work_for_device_1_touch_device_0(guarded: bool) -> None:
    """torch.cuda.stream(s) left from a thread whose current device is 0 sets device 0 (a context
    there); the runtime's on_stream puts the device guard first."""
    import threading

    from offload_adam.runtime.device import on_stream

    with testing.simulated_device(max_delay_s=0.0, index=1) as sim:
        def work() -> None:  # a fresh thread: its current device is 0
            ctx = on_stream(sim.cuda, 1, sim.h2d) if guarded else sim.cuda.stream(sim.h2d)
            with ctx:
                pass

        t = threading.Thread(target=work)
        t.start()
        t.join()
        PinnedArena(sim).alloc(16, torch.float32)  # registered under device 1 by the device itself
    assert (sim.violations == []) == guarded, sim.violations
    if not guarded:
        assert sim.violations == ["device 0: a context created by work for device 1 (leaving torch.cuda.stream: set_device of the stream current before): hundreds of MiB on GPU 0"]


def test_the_simulator_counts_host_waits_on_compute_events_and_registrations() -> None:
    with testing.simulated_device(max_delay_s=0.0) as sim:
        before = sim.counters()
        sim.host_wait(sim.record(sim.h2d))  # no compute in it
        sim.stream_waits(sim.d2h, sim.record_current())
        sim.host_wait(sim.record(sim.d2h))  # follows the compute
        PinnedArena(sim).alloc(16, torch.float32)
        after = sim.counters()
    assert after["host_waits_on_compute"] - before["host_waits_on_compute"] == 1
    assert after["registrations"] - before["registrations"] == 1


# -- the pager ----------------------------------------------------------------------------------


def _family(pager: Pager, n: int = 4 * 2048) -> tuple[Family, dict[str, torch.Tensor]]:
    fam = pager.family("f", n)
    bufs = {"a": aligned_empty(n, torch.float32), "b": aligned_empty(n, torch.bfloat16)}
    for k, b in bufs.items():
        pager.add_buffer(fam, k, b)
    return fam, bufs


@pytest.mark.parametrize("budget_pages", [0, 1])
def test_the_pager_pages_a_family_of_buffers_through_the_window(tmp_path: Any, budget_pages: int) -> None:
    """Buffers it knows nothing about: each page is written back and given to the OS on release
    (its memory reads zeros), read back and checked on make_resident; pages in the host budget
    never leave RAM."""
    run = PageStore(str(tmp_path))
    pager = Pager(run, host_budget_bytes=budget_pages * 2048 * 6, read_ahead=1, write_behind=1)
    fam, bufs = _family(pager)
    pages = pager.add_pages(fam, [(k * 2048, (k + 1) * 2048, f"page {k}") for k in range(4)], "the test data")
    assert [pager.pages[k].pinned for k in pages] == [k < budget_pages for k in range(4)]
    want = {}
    for k in pages:
        pager.make_resident([k])
        for name, b in bufs.items():
            b[k * 2048 : (k + 1) * 2048] = torch.arange(2048, dtype=torch.float32).to(b.dtype) + k
        want[k] = {name: b[k * 2048 : (k + 1) * 2048].clone() for name, b in bufs.items()}
        pager.release([k])
    pager.end_step()
    for k in pages:
        p = pager.pages[k]
        if not p.pinned and not p.resident and p.reading is None:  # (read ahead: page 0 is on its way back)
            assert bool((bufs["a"][k * 2048 : (k + 1) * 2048] == 0).all())  # given back to the OS
    for k in pages:
        pager.make_resident([k])
        for name, b in bufs.items():
            assert torch.equal(b[k * 2048 : (k + 1) * 2048], want[k][name]), (k, name)
        pager.release([k], wrote=False)
    pager.end_step()
    assert pager.memory()["nvme_bytes"] == (4 - budget_pages) * 2048 * 6
    page = 2048 * 6
    assert pager.stats["write_bytes"] == (4 - budget_pages) * page  # the second pass only read
    # Read: pages 1-3 in the second pass; page 0 each time read ahead after the last page.
    assert pager.stats["read_bytes"] == (3 + (2 if budget_pages == 0 else 0)) * page
    pager.close()
    run.close()
    assert not os.path.exists(run.path)


def test_a_corrupted_page_names_its_file_and_what_it_holds(tmp_path: Any) -> None:
    run = PageStore(str(tmp_path))
    pager = Pager(run, read_ahead=0, corrupt_hint="; do something")
    fam, bufs = _family(pager, 2048)
    (k,) = pager.add_pages(fam, [(0, 2048, "the test page")], "the test data")
    pager.make_resident([k])
    bufs["a"].fill_(1.0)
    pager.release([k])
    pager.end_step()
    with open(fam.files["a"].path, "r+b") as f:
        f.write(b"\x01\x02")
    with pytest.raises(OSError, match=r"f-a\.bin: the test page is corrupted \(checksum mismatch\); do something"):
        pager.make_resident([k])
    run.close()


def test_a_run_directory_checks_the_space_its_pages_need(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import offload_adam.runtime.pages as pager_mod

    run = PageStore(str(tmp_path))
    real = pager_mod.shutil.disk_usage
    monkeypatch.setattr(pager_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    pager = Pager(run)
    fam, _ = _family(pager, 2048)
    with pytest.raises(OSError, match=r"the test data needs 12288 bytes under .* which has 1000 free"):
        pager.add_pages(fam, [(0, 2048, "p")], "the test data")
    with pytest.raises(ValueError, match="nvme_dir: .* is not a directory"):
        PageStore(str(tmp_path / "missing"))
    run.close()


# -- the module schedule ------------------------------------------------------------------------


class _Recording:
    def __init__(self, name: str, log: list[Any], watched: dict[int, str]) -> None:
        self.name, self.log, self.watched = name, log, watched

    def pre_forward(self, module: torch.nn.Module) -> None:
        self.log.append((self.name, "pre", type(module).__name__))

    def post_forward(self, module: torch.nn.Module) -> None:
        self.log.append((self.name, "post", type(module).__name__))

    def read_key(self, t: torch.Tensor) -> Any:
        return self.watched.get(id(t))

    def on_read(self, module: torch.nn.Module, key: Any) -> None:
        self.log.append((self.name, "read", type(module).__name__, key))

    def pass_ended(self, recorded: bool) -> None:
        self.log.append((self.name, "end", recorded))


class _Parent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x) @ self.child.weight  # reads the child's weight itself too


def test_subscribers_see_every_module_and_a_recorded_pass_attributes_reads() -> None:
    m = _Parent()
    log: list[Any] = []
    a = _Recording("a", log, {id(m.child.weight): "w"})
    b = _Recording("b", log, {})
    sa, sb = SCHEDULE.subscribe(a), SCHEDULE.subscribe(b)
    try:
        sa.record_next()
        m(torch.randn(2, 3))
        reads = [e for e in log if e[1] == "read"]
        assert ("a", "read", "_Parent", "w") in reads  # the parent's own read
        assert ("a", "read", "Linear", "w") in reads  # F.linear inside the child
        calls = [e for e in log if e[1] in ("pre", "post")]
        assert calls == [
            ("a", "pre", "_Parent"), ("b", "pre", "_Parent"), ("a", "pre", "Linear"), ("b", "pre", "Linear"),
            ("b", "post", "Linear"), ("a", "post", "Linear"), ("b", "post", "_Parent"), ("a", "post", "_Parent"),
        ]  # fmt: skip
        assert log[-2:] == [("a", "end", True), ("b", "end", False)]
        log.clear()
        m(torch.randn(2, 3))  # not recorded again
        assert not [e for e in log if e[1] == "read"] and log[-2:] == [("a", "end", False), ("b", "end", False)]
        log.clear()
        with pytest.raises(RuntimeError):
            m(torch.randn(2, 4))  # a forward that raises still ends its pass
        assert log[-2:] == [("a", "end", False), ("b", "end", False)]
    finally:
        sa.cancel()
        sb.cancel()
    assert not SCHEDULE._handles  # no subscriber, no global hooks
    log.clear()
    m(torch.randn(2, 3))
    assert log == []
