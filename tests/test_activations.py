"""Activations offloaded (offload_activations), on the simulated device (models and inputs moved
there as to "cuda"): copies
after random delays, lazy stream waits, device memory uninitialized (NaN, bytes 0xA5). The
gradients are bitwise those of the same model without offloading: they are the same tensors."""

from __future__ import annotations

import contextlib
import copy
import errno
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing

from helpers import to_device, to_host

transformers = pytest.importorskip("transformers")
VOCAB = 128


def gpt2(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).to(dtype).train()


def llama(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(dtype).train()


MODELS = {"gpt2": gpt2, "llama": llama}


def loss_of(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())


def data(seed: int, n: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return [to_device(torch.randint(3, VOCAB, (4, 65), generator=g)) for _ in range(n)]


def checkpointing(m: torch.nn.Module, how: str | None) -> None:
    if how is not None:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "reentrant"})


@pytest.fixture
def nvme_dir(tmp_path: Any) -> Iterator[str]:
    d = tmp_path / "nvme"
    d.mkdir()
    yield str(d)
    assert os.listdir(d) == [], "the run directory was left behind"


_CASES = [
    (arch, dtype, ck, storage, inside)
    for k, (arch, dtype, ck) in enumerate(
        (a, d, c) for a in MODELS for d in (torch.float32, torch.bfloat16) for c in (None, "non-reentrant", "reentrant")
    )
    for storage, inside in [(("cpu", "nvme")[k % 2], bool(k // 2 % 2))]
]


@pytest.mark.parametrize("arch, dtype, ck, storage, inside", _CASES)
def test_gradients_are_bitwise_the_unoffloaded_models(
    arch: str, dtype: torch.dtype, ck: str | None, storage: str, inside: bool, tmp_path: Any
) -> None:
    seed = len(arch) + (dtype == torch.bfloat16)
    nv = {"storage": "nvme", "nvme_dir": str(tmp_path)} if storage == "nvme" else {}
    with testing.simulated_device(seed=seed, max_delay_s=0.001) as sim:
        m = to_device(MODELS[arch](dtype, seed))
        ref = copy.deepcopy(m)
        checkpointing(m, ck)
        checkpointing(ref, ck)
        (x,) = data(seed)
        loss_of(ref, x).backward()
        ao = offload_adam.offload_activations(min_bytes=1024, prefetch=1 + seed % 2, **nv)
        with ao:
            loss = loss_of(m, x)
            ao.flush()  # (nvme: every saved storage on the SSD now, read back in the backward)
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
        rep = ao.report()
        assert rep["offloaded_bytes"] > 0 and rep["h2d_bytes"] == rep["d2h_bytes"] == rep["offloaded_bytes"]
        if ck is None:
            assert rep["offloaded_bytes"] >= 0.8 * (rep["offloaded_bytes"] + rep["kept_bytes"]), rep
        if storage == "nvme":
            assert rep["write_bytes"] > 0 and rep["read_bytes"] > 0
        ao.close()
        assert sim.violations == []
    assert os.listdir(tmp_path) == []


def test_a_storage_saved_twice_or_through_two_views_is_offloaded_once() -> None:
    with testing.simulated_device(seed=3, max_delay_s=0.001):
        w = to_device(torch.randn(64, 64)).requires_grad_()
        ref = None
        for offload in (False, True):
            ao = offload_adam.offload_activations(min_bytes=1024)
            with ao if offload else contextlib.nullcontext():
                h = w * 2  # a fresh storage of 16 KiB (a product by a scalar saves nothing)
                y = (h * h).sum() + (h[:, :32] * h[:, 32:]).sum()  # h twice; two views of it
            y.backward()
            g = w.grad.clone()
            w.grad = None
            if ref is None:
                ref = g
            else:
                assert torch.equal(g, ref)
                rep = ao.report()
                assert rep["offloaded_tensors"] == 1 and rep["offloaded_bytes"] == h.untyped_storage().nbytes()
                assert rep["deduplicated_tensors"] == 3
            ao.close()


def test_small_tensors_and_parameters_stay_on_the_device() -> None:
    with testing.simulated_device(seed=0, max_delay_s=0.0):
        lin = to_device(torch.nn.Linear(256, 256))
        x = to_device(torch.randn(2, 256)).requires_grad_()  # a leaf that requires grad: kept
        with offload_adam.offload_activations(min_bytes=4096) as ao:
            y = torch.tanh(lin(x))  # saves x, weight (parameters: kept) and tanh's 2 KiB output (small)
            z = torch.sigmoid(to_device(torch.randn(64, 64)).requires_grad_()).sum()  # its 16 KiB output: offloaded
        (y.sum() + z).backward()
        rep = ao.report()
        assert rep["offloaded_tensors"] == 1 and rep["offloaded_bytes"] == 64 * 64 * 4
        assert rep["kept_tensors"] >= 3
        ao.close()


def test_host_memory_is_bounded_and_reused_between_steps() -> None:
    with testing.simulated_device(seed=1, max_delay_s=0.001):
        m = to_device(gpt2(torch.float32, 0))
        ao = offload_adam.offload_activations(min_bytes=1024)
        held = []
        for x in data(1, 5):
            with ao:
                loss = loss_of(m, x)
            loss.backward()
            held.append(ao.report()["host_pinned_bytes"])
        per_step = ao.report()["offloaded_bytes"] / 5
        assert held[1:] == held[:1] * 4, held  # the slabs of the first step serve the next ones
        assert held[0] <= 2 * per_step + (1 << 20)
        ao.close()


def test_the_module_form_offloads_only_what_chosen_modules_save() -> None:
    with testing.simulated_device(seed=2, max_delay_s=0.001):
        m = to_device(llama(torch.float32, 2))
        ref = copy.deepcopy(m)
        (x,) = data(2)
        loss_of(ref, x).backward()
        whole = offload_adam.offload_activations(min_bytes=1024)
        with whole:
            loss_of(copy.deepcopy(m), x).backward()
        ao = offload_adam.offload_activations(min_bytes=1024, modules=[m.model.layers[0]])
        loss_of(m, x).backward()  # no `with`: the hooks of the chosen module
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        part, everything = ao.report()["offloaded_bytes"], whole.report()["offloaded_bytes"]
        assert 0 < part < 0.7 * everything
        ao.close()  # the hooks removed
        loss_of(m, x).backward()
        assert ao.report()["offloaded_bytes"] == part
        whole.close()


def test_a_second_backward_with_retain_graph() -> None:
    with testing.simulated_device(seed=4, max_delay_s=0.001):
        m = to_device(gpt2(torch.float32, 4))
        ref = copy.deepcopy(m)
        (x,) = data(4)
        lr = loss_of(ref, x)
        lr.backward(retain_graph=True)
        lr.backward()
        with offload_adam.offload_activations(min_bytes=1024) as ao:
            loss = loss_of(m, x)
        loss.backward(retain_graph=True)
        loss.backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert ao.report()["h2d_bytes"] == 2 * ao.report()["offloaded_bytes"]
        ao.close()


@pytest.mark.parametrize("storage", ["cpu", "nvme"])
def test_with_streamed_weights_and_our_optimizer_training_is_bitwise_the_same(storage: str, nvme_dir: str) -> None:
    """Weights streamed by offload_weights (their saved tensors are the streamer's tokens, the
    rest goes to the activation offload), the optimizer offloading: training is bitwise the same
    training without offloading the activations."""
    nv = {"storage": "nvme", "nvme_dir": nvme_dir} if storage == "nvme" else {}
    with testing.simulated_device(seed=5, max_delay_s=0.001) as sim:
        out = []
        for offload in (False, True):
            m = gpt2(torch.bfloat16, 5)
            h = offload_adam.offload_weights(m, prefetch=1)
            opt = offload_adam.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=0.05)
            ao = offload_adam.offload_activations(min_bytes=1024, **nv)
            for x in data(5, 6):
                if offload:
                    with ao:
                        loss = loss_of(m, x)
                else:
                    loss = loss_of(m, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            from offload_adam.runtime.hosted import home_of

            out.append([home_of(p).host.clone() for p in m.parameters()])  # type: ignore[union-attr]
            if offload:
                assert ao.report()["offloaded_bytes"] > 0
            ao.close()
            opt.close()
            h.close()
        assert all(torch.equal(a, b) for a, b in zip(*out))
        assert sim.violations == []


def test_bad_arguments_are_refused_clearly(tmp_path: Any) -> None:
    with testing.simulated_device(seed=0, max_delay_s=0.0):
        with pytest.raises(ValueError, match="min_bytes must be an integer >= 0"):
            offload_adam.offload_activations(min_bytes=-1)
        with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
            offload_adam.offload_activations(prefetch=1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="storage must be one of"):
            offload_adam.offload_activations(storage="disk")
        with pytest.raises(ValueError, match="nvme_dir: storage='nvme' needs a directory"):
            offload_adam.offload_activations(storage="nvme")
        with pytest.raises(ValueError, match="nvme_dir is only for storage='nvme'"):
            offload_adam.offload_activations(nvme_dir=str(tmp_path))
        with pytest.raises(TypeError, match="modules: expected nn.Modules"):
            offload_adam.offload_activations(modules=[1])
        with pytest.raises(ValueError, match="not a directory"):
            with offload_adam.offload_activations(storage="nvme", nvme_dir=str(tmp_path / "missing"), min_bytes=0):
                (to_device(torch.randn(64, 64)).requires_grad_() * 2).exp().sum().backward()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device here"):
            offload_adam.offload_activations()


def test_activations_bench_reports_the_bytes_kept_and_moved() -> None:
    from offload_adam.tools import activations_bench

    res = activations_bench.simulated(rounds=1, min_bytes=1024)
    r = res["report"]
    assert r["offloaded_bytes"] >= 0.8 * (r["offloaded_bytes"] + r["kept_bytes"])
    assert r["h2d_bytes"] == r["d2h_bytes"] == r["offloaded_bytes"]


def test_the_free_list_reuses_and_merges_released_ranges() -> None:
    from offload_adam.runtime.pinned import SLAB, FreeList

    made: list[int] = []

    def grow(n: int) -> tuple[int, int]:
        made.append(max(n, SLAB))
        return len(made) - 1, made[-1]

    fl = FreeList(grow, 512)
    a, b, c = fl.alloc(1000), fl.alloc(512), fl.alloc(10)
    assert [a, b, c] == [(0, 0), (0, 1024), (0, 1536)] and len(made) == 1
    fl.release(*a, 1000)
    fl.release(*b, 512)
    assert fl.alloc(1536) == (0, 0)  # the two released ranges merged
    assert fl.alloc(SLAB) == (1, 0) and len(made) == 2  # too large for the first: a new segment


# -- the CUDA review's findings (December) on the simulated device -------------------------------------


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))  # saves tanh's 64x64 output: one storage per layer
        return x


def test_a_handle_made_every_step_pins_nothing_new() -> None:
    """Finding 6: the README's ``with offload_activations() as ao:`` inside the loop makes a
    handle per step; the pinned pool is the device's, so the steps after the first register no
    host memory."""
    with testing.simulated_device(seed=1, max_delay_s=0.001) as sim:
        m = to_device(gpt2(torch.float32, 0))
        regs = []
        for x in data(1, 5):
            with offload_adam.offload_activations(min_bytes=1024):
                loss = loss_of(m, x)
            loss.backward()
            regs.append(sim.counters()["registrations"])
        assert regs[0] > 0 and regs[1:] == [regs[0]] * 4, regs


def test_events_stay_bounded_from_step_to_step() -> None:
    """Finding 9: the timing events around each compute wait are folded as they complete, not
    kept until reset_stats(): the events alive stay the same from step to step."""
    import gc

    with testing.simulated_device(seed=1, max_delay_s=0.001) as sim:
        m = to_device(gpt2(torch.float32, 0))
        ao = offload_adam.offload_activations(min_bytes=1024)
        live = []
        for x in data(1, 8):
            with ao:
                loss = loss_of(m, x)
            loss.backward()
            sim.drain()
            gc.collect()
            live.append(sim.counters()["live_events"])
        assert max(live[2:]) <= min(live[2:]) + 2 * 16 + 8, live  # (up to 16 pairs wait for their fold)
        assert ao.report()["stall_s"] >= 0.0
        ao.close()


def test_saved_storages_whose_copy_has_not_run_are_capped() -> None:
    """Finding 11: a forward that saves faster than the copies drain keeps every device storage
    until its copy has run; beyond max_inflight_bytes the forward waits for the oldest."""
    import threading

    with testing.simulated_device(seed=3, max_delay_s=0.001) as sim:
        m = to_device(_Chain())
        x = to_device(torch.randn(64, 64)).requires_grad_()
        cap = 3 * 64 * 64 * 4
        release = sim.hold(sim.d2h)  # the copies out run only once released: the forward saves faster
        timer = threading.Timer(0.5, release)
        timer.start()
        try:
            with offload_adam.offload_activations(min_bytes=1024, max_inflight_bytes=cap) as ao:
                loss = m(x).sum()
        finally:
            timer.cancel()
            release()
        loss.backward()
        rep = ao.report()
        assert rep["inflight_peak_bytes"] <= cap + 64 * 64 * 4 and rep["inflight_waits"] > 0, rep
        ao.close()
    assert sim.violations == []


def test_nvme_reloads_wait_for_their_region_not_for_every_copy_queued(nvme_dir: str) -> None:
    """Finding 8: an NVMe reload into a region waits only for the copies that used that region
    last, not for everything queued on the side streams (on a GPU the d2h stream carries the
    optimizer's gradient copies, which follow the backward's compute: waiting for them drains the
    GPU at every reload). Here the d2h stream is held after the forward: the backward must
    finish without it."""
    import threading

    with testing.simulated_device(seed=4, max_delay_s=0.001) as sim:
        m = to_device(_Chain())
        x = to_device(torch.randn(64, 64)).requires_grad_()
        with offload_adam.offload_activations(min_bytes=1024, storage="nvme", nvme_dir=nvme_dir, prefetch=1) as ao:
            loss = m(x).sum()
        ao.flush()  # every saved storage on the SSD: the backward reloads them
        assert ao.report()["write_bytes"] > 0
        release = sim.hold(sim.d2h)
        timed_out = threading.Event()
        timer = threading.Timer(30.0, lambda: (timed_out.set(), release()))
        timer.start()
        try:
            loss.backward()
        finally:
            timer.cancel()
            release()
        assert not timed_out.is_set(), "an NVMe reload waited for the d2h stream"
        assert ao.report()["read_bytes"] > 0
        ao.close()
    assert sim.violations == []


def test_copies_needed_now_do_not_queue_behind_a_stalled_prefetch() -> None:
    """Finding 12: every client's copies to the device shared one queue, so a copy needed now (a
    block loaded at its activation, a saved tensor unpacked) waited behind a prefetch that waits
    for the compute to free its slot. Demand loads go to the device's priority stream: with the
    prefetch stream held, a forward and backward that load everything on demand finish."""
    import threading

    with testing.simulated_device(seed=6, max_delay_s=0.001) as sim:
        m = gpt2(torch.float32, 6)  # (on the host: offload_weights streams it)
        (x,) = data(6)
        ref = to_device(copy.deepcopy(m))
        loss_of(ref, x).backward()
        h = offload_adam.offload_weights(m, prefetch=0)
        release = sim.hold(sim.h2d)  # a prefetch stuck behind the compute
        timed_out = threading.Event()
        timer = threading.Timer(30.0, lambda: (timed_out.set(), release()))
        timer.start()
        try:
            with offload_adam.offload_activations(min_bytes=1024, prefetch=0) as ao:
                loss = loss_of(m, x)
            loss.backward()
        finally:
            timer.cancel()
            release()
        assert not timed_out.is_set(), "a copy needed now waited behind the prefetch stream"
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(to_host(p.grad), to_host(q.grad)), n
        assert ao.report()["loads"] > 0
        ao.close()
        h.close()
    assert sim.violations == []


def test_smaller_items_a_tensor_of_another_device_warns_and_graph_capture_is_refused() -> None:
    """Finding 14: a handle made for the current device keeps (does not offload) what another
    device of the same kind saves: it says so, once, with the device to pass; under a CUDA graph
    capture the weights' and the activations' hooks refuse to run (their copies are issued from
    the host at each call, so a replay would skip them)."""
    with testing.simulated_device(seed=0, max_delay_s=0.0) as sim:
        ao = offload_adam.offload_activations(min_bytes=0)
        here = sim.torch_device
        sim.torch_device = torch.device(here.type, 1)  # the handle's device is another index
        with pytest.warns(UserWarning, match=rf"saved on {here} is kept there.*pass device='{here}'"):
            with ao:
                (torch.randn(64, 64, device=here, requires_grad=True) * 2).exp().sum().backward()
        sim.torch_device = here
        assert ao.report()["offloaded_tensors"] == 0
        sim.graph_capture = True
        with pytest.raises(RuntimeError, match="offload_activations cannot run inside a CUDA graph capture"):
            with ao:
                (to_device(torch.randn(64, 64)).requires_grad_() * 2).exp().sum()
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        sim.graph_capture = False
        h = offload_adam.offload_weights(m)
        sim.graph_capture = True
        with pytest.raises(RuntimeError, match="offload_weights cannot run inside a CUDA graph capture"):
            m(to_device(torch.randn(2, 8)))
        sim.graph_capture = False
        h.close()
        ao.close()


def test_flush_writes_even_when_no_copy_out_had_run_by_the_last_save(nvme_dir: str) -> None:
    """flush() wrote nothing when no saved storage's copy out had run while the forward saved
    (the page store is made at the first write, and flush looked for it): the regions stayed in
    RAM. The d2h stream held through the forward makes that case every time."""
    with testing.simulated_device(seed=1, max_delay_s=0.0) as sim:
        m = to_device(_Chain())
        x = to_device(torch.randn(64, 64)).requires_grad_()
        release = sim.hold(sim.d2h)
        with offload_adam.offload_activations(min_bytes=1024, storage="nvme", nvme_dir=nvme_dir, prefetch=0) as ao:
            loss = m(x).sum()
        release()
        assert ao.report()["write_bytes"] == 0  # nothing could be written behind
        ao.flush()
        assert ao.report()["write_bytes"] >= 6 * 64 * 64 * 4
        loss.backward()
        ao.close()
    assert sim.violations == []


def _fail_writes(monkeypatch: pytest.MonkeyPatch, op: str, after: int) -> None:
    """Every page store made from now on fails its I/O engine's ``op`` number ``after`` (0: the
    first) with ENOSPC."""
    from offload_adam.runtime.pages import RunDir

    real = RunDir.__init__

    def init(self: RunDir, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.io.inject_fault(op, errno.ENOSPC, after)

    monkeypatch.setattr(RunDir, "__init__", init)


def test_a_failed_write_is_written_again_never_read_back_unwritten(nvme_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush() whose write failed (ENOSPC) raised once; the next flush() took that write as
    done (a failed Transfer's second wait returned), released its region, and the backward read
    the range never written: silently wrong gradients. The write is tried again instead, and the
    gradients are bitwise those of the model without offloading."""
    _fail_writes(monkeypatch, "write", 1)
    with testing.simulated_device(seed=3, max_delay_s=0.0) as sim:
        m = to_device(_Chain())
        ref = copy.deepcopy(m)
        x = to_device(torch.randn(64, 64)).requires_grad_()
        ref(x.detach().clone().requires_grad_()).sum().backward()
        release = sim.hold(sim.d2h)  # nothing written behind during the forward: flush() writes it all
        with offload_adam.offload_activations(min_bytes=1024, storage="nvme", nvme_dir=nvme_dir, prefetch=0) as ao:
            loss = m(x).sum()
        release()
        with pytest.raises(OSError, match=r"writing a saved storage of \d+ bytes to .*activations-0\.bin.*No space left on device"):
            ao.flush()
        ao.flush()  # the disk has room again: the failed write is done now
        loss.backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
        assert ao.report()["write_bytes"] >= 7 * 64 * 64 * 4  # six storages, one of them twice
        ao.close()
    assert sim.violations == []


def _open_under(d: str) -> list[str]:
    root = os.path.realpath(d) + os.sep
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [link for link in links if link.startswith(root)]


def test_close_after_a_failed_flush_gives_everything_back(nvme_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush() on a disk without room for the first 64 MiB segment raised ENOSPC; close() in
    the except block wrote the pending regions again, raised the same error, kept closed False
    and the run directory (as long as the failed graph lived). It drops the pending writes
    instead: nothing raised, the directory and its descriptors gone, and the saved tensors,
    never written, still come back from RAM."""
    import offload_adam.runtime.pages as pages

    real = pages.shutil.disk_usage
    monkeypatch.setattr(pages.shutil, "disk_usage", lambda p: real(p)._replace(free=4 << 20))
    with testing.simulated_device(seed=4, max_delay_s=0.0) as sim:
        m = to_device(_Chain())
        ref = copy.deepcopy(m)
        x = to_device(torch.randn(64, 64)).requires_grad_()
        ref(x.detach().clone().requires_grad_()).sum().backward()
        release = sim.hold(sim.d2h)  # nothing written behind during the forward
        with offload_adam.offload_activations(min_bytes=1024, storage="nvme", nvme_dir=nvme_dir, prefetch=0) as ao:
            loss = m(x).sum()
        release()
        try:
            ao.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC and "needs 67108864 bytes under" in str(e)
            ao.close()
            assert ao.closed
            assert os.listdir(nvme_dir) == [] and _open_under(nvme_dir) == []
        else:
            raise AssertionError("flush() did not raise")
        ao.close()  # again: nothing
        loss.backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
    assert sim.violations == []


