"""The NVMe tier (``offload="nvme"``): bitwise the RAM tier's results in every mode, on both I/O
backends; files, locks, cleanup and checksums; streaming checkpoints; I/O faults mid-step; RAM
bounded by the window. Everything is written under pytest's temporary directories."""

from __future__ import annotations

import copy
import errno
import gc
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import clone_params

from offload_adam import AdamW, _native, testing
from offload_adam.runtime.pages import RUN_PREFIX, remove_stale_runs, stale_runs

SHAPES = [(300, 200), (7,), (5000,), (64, 64), (1,), (100, 100), (3, 5, 7)]
BUCKET_MB = 0.05  # several buckets (pages) for these shapes


def _uring_ok() -> bool:
    try:
        _native.IoEngine("uring")
    except RuntimeError:
        return False
    return True


@pytest.fixture(params=["uring", "threads"])
def io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "uring" and not _uring_ok():
        pytest.skip("io_uring is refused here")
    monkeypatch.setenv("OFFLOAD_ADAM_IO", request.param)
    return str(request.param)


@pytest.fixture
def nvme_dir(tmp_path: Any) -> Iterator[str]:
    d = str(tmp_path / "nvme")
    os.mkdir(d)
    yield d
    gc.collect()
    assert [n for n in os.listdir(d) if n.startswith(RUN_PREFIX)] == [], "run directories left behind"


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(ps: list[torch.nn.Parameter], t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in ps]


def _groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3, "weight_decay": 0.0}]


def _train(opt: Any, ps: list[torch.nn.Parameter], steps: range, clip: float | None = None) -> None:
    for t in steps:
        for p, g in zip(ps, _grads(ps, t)):
            p.grad = g.clone()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()


def _assert_identical(a: Any, b: Any, ps: list[torch.nn.Parameter], qs: list[torch.nn.Parameter]) -> None:
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k, v in sb["state"].items():
        assert v.keys() == sa["state"][k].keys()
        for kk, t in v.items():
            assert torch.equal(sa["state"][k][kk], t), (k, kk)


MODES: list[dict[str, Any]] = [
    {},
    {"amsgrad": True, "weight_decay": 0.1},
    {"state_dtype": torch.bfloat16},
    {"host_budget_gb": 0.3 / 1024},  # about half of the state in RAM
    {"clip": 1.0},
    {"nvme_read_ahead": 0},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES, ids=["default", "amsgrad", "bf16-state", "half-budget", "clip", "no-read-ahead"])
def test_cpu_groups_bitwise_equal_to_ram_tier(io: str, nvme_dir: str, mode: dict[str, Any], dtype: torch.dtype) -> None:
    mode = dict(mode)
    clip = mode.pop("clip", None)
    ps, qs = _params(dtype), _params(dtype)
    nv = AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB, **mode)
    mode.pop("host_budget_gb", None)
    mode.pop("nvme_read_ahead", None)
    ram = AdamW(_groups(qs), lr=1e-2, bucket_mb=BUCKET_MB, **mode)
    _train(nv, ps, range(25), clip)
    _train(ram, qs, range(25), clip)
    _assert_identical(nv, ram, ps, qs)
    rep = nv.memory_report()
    assert rep["nvme_bytes"] > 0 and rep["window_bytes"] > 0
    stats = nv.last_step_stats
    assert stats["read_bytes"] > 0 and stats["write_bytes"] == stats["read_bytes"]
    nv.close()


@pytest.mark.parametrize("budget", [0.0, 0.3 / 1024], ids=["all-paged", "half-budget"])
def test_amsgrad_switched_on_later_bitwise_equal_to_ram_tier(nvme_dir: str, budget: float) -> None:
    """The maximum starts from the state as it is (``exp_avg_sq``) on every page, resident,
    paged or kept in RAM by the budget, as in the RAM tier."""
    ps, qs = _params(), _params()
    nv = AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB, host_budget_gb=budget)
    ram = AdamW(_groups(qs), lr=1e-2, bucket_mb=BUCKET_MB)
    for opt, xs in ((nv, ps), (ram, qs)):
        _train(opt, xs, range(5))
        for g in opt.param_groups:
            g["amsgrad"] = True
        _train(opt, xs, range(5, 12))
    _assert_identical(nv, ram, ps, qs)
    nv.close()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.mark.parametrize(
    "mode",
    [{}, {"async_step": True}, {"free_gradients": True}, {"accumulate": 2}, {"async_step": True, "amsgrad": True}],
    ids=["sync", "async", "free-gradients", "accumulation", "async-amsgrad"],
)
def test_offloaded_groups_bitwise_equal_to_ram_tier(nvme_dir: str, mode: dict[str, Any]) -> None:
    """The streamed (GPU) path, through the simulated device."""
    mode = dict(mode)
    micro = mode.pop("accumulate", 1)
    outs = []
    for tier in ("nvme", "cpu"):
        with testing.simulated_device(seed=3, max_delay_s=0.001) as dev:
            torch.manual_seed(0)
            m = Net().to(dev.torch_device)  # on the device, as a user moves it to "cuda"
            extra = {"offload": "nvme", "nvme_dir": nvme_dir} if tier == "nvme" else {}
            opt = AdamW(m.parameters(), lr=1e-2, bucket_mb=0.005, **extra, **mode)
            g = torch.Generator().manual_seed(5)
            for _ in range(12):
                for _ in range(micro):
                    x = torch.randn(8, 32, generator=g).to(dev.torch_device)
                    m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            outs.append(([p.detach().cpu() for p in m.parameters()], opt.state_dict()))
            opt.close()
        assert dev.violations == []
    (wa, sa), (wb, sb) = outs
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    for k, v in sb["state"].items():
        for kk, t in v.items():
            assert torch.equal(sa["state"][k][kk], t), (k, kk)


# -- checkpoints ----------------------------------------------------------------------------------


def test_state_dict_interchanges_with_torch(nvme_dir: str) -> None:
    ps, qs, rs = _params(), _params(), _params()
    ref = torch.optim.AdamW(_groups(rs), lr=1e-2)
    _train(ref, rs, range(5))
    nv = AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB)
    ram = AdamW(_groups(qs), lr=1e-2, bucket_mb=BUCKET_MB)
    for p, q, r in zip(ps, qs, rs):
        p.data.copy_(r)
        q.data.copy_(r)
    nv.load_state_dict(ref.state_dict())
    ram.load_state_dict(ref.state_dict())
    _train(nv, ps, range(5, 12))
    _train(ram, qs, range(5, 12))
    _assert_identical(nv, ram, ps, qs)
    # and back into torch's
    back = torch.optim.AdamW(_groups(_params()), lr=1e-2)
    back.load_state_dict(nv.state_dict())
    for k, v in back.state_dict()["state"].items():
        torch.testing.assert_close(v["exp_avg"], ram.state_dict()["state"][k]["exp_avg"], rtol=0, atol=0)
    nv.close()


@pytest.mark.parametrize("into", ["nvme", "cpu"])
@pytest.mark.parametrize("mode", [{}, {"amsgrad": True, "state_dtype": torch.bfloat16}], ids=["default", "amsgrad-bf16"])
def test_streaming_checkpoint_resumes_exactly_in_any_tier(nvme_dir: str, tmp_path: Any, into: str, mode: dict[str, Any]) -> None:
    dtype = torch.bfloat16 if mode else torch.float32  # bf16 parameters: masters in the file
    ps, qs = _params(dtype), _params(dtype)
    a = AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB, **mode)
    _train(a, ps, range(6))
    ckpt = str(tmp_path / "ckpt")
    path = a.save_state(ckpt)
    assert os.listdir(ckpt) == ["optimizer.safetensors"]
    for p, q in zip(ps, qs):
        q.data.copy_(p)
    extra = {"offload": "nvme", "nvme_dir": nvme_dir} if into == "nvme" else {}
    b = AdamW(_groups(qs), lr=0.5, bucket_mb=BUCKET_MB, state_dtype=mode.get("state_dtype", torch.float32), **extra)
    b.load_state(ckpt)
    _train(a, ps, range(6, 15))
    _train(b, qs, range(6, 15))
    _assert_identical(a, b, ps, qs)
    st = pytest.importorskip("safetensors")  # other tools read it
    with st.safe_open(path, framework="pt") as f:
        assert "state.0.exp_avg" in set(f.keys())
        assert "param_groups" in f.metadata()
    a.close()
    b.close()


def test_reading_checkpoints_writes_nothing_back(nvme_dir: str, tmp_path: Any) -> None:
    """state_dict(), copies and save_state() read the paged state and give its memory back
    without writing it again (no I/O, no wear); a later step still reads what is on disk."""
    ps, qs = _params(), _params()
    a = AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB)
    ram = AdamW(_groups(qs), lr=1e-2, bucket_mb=BUCKET_MB)
    _train(a, ps, range(3))
    _train(ram, qs, range(3))
    io = a._engine.tier.pager.io
    written = io.bytes()[1]
    a.state_dict()
    copy.deepcopy(a).close()  # the copy writes its own files, in its own directory
    a.save_state(str(tmp_path / "ckpt"))
    assert io.bytes()[1] == written
    assert sum(p.resident and not p.pinned for p in a._engine.tier.pager.pages) <= a._engine.tier.pager.read_ahead
    _train(a, ps, range(3, 6))
    _train(ram, qs, range(3, 6))
    _assert_identical(a, ram, ps, qs)
    a.close()


def test_a_failed_checkpoint_write_leaves_the_previous_one(nvme_dir: str, tmp_path: Any) -> None:
    ps = _params()
    a = AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB)
    _train(a, ps, range(3))
    ckpt = str(tmp_path / "ckpt")
    a.save_state(ckpt)
    before = open(os.path.join(ckpt, "optimizer.safetensors"), "rb").read()
    _train(a, ps, range(3, 5))
    a._engine.tier.pager.io.inject_fault("read", errno.EIO, 2)
    with pytest.raises(OSError, match="Input/output error"):
        a.save_state(ckpt)
    assert os.listdir(ckpt) == ["optimizer.safetensors"]
    assert open(os.path.join(ckpt, "optimizer.safetensors"), "rb").read() == before
    a.close()


# -- files ----------------------------------------------------------------------------------------


def test_run_directory_is_private_locked_and_removed(nvme_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    ps = _params()
    with caplog.at_level(logging.INFO, logger="offload_adam"):
        a = AdamW(ps, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB)
        b = AdamW(_params(), offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB)
    assert any("written per step" in r.getMessage() and "TB per 1000 steps" in r.getMessage() for r in caplog.records)
    runs = sorted(n for n in os.listdir(nvme_dir) if n.startswith(RUN_PREFIX))
    assert len(runs) == 2  # two optimizers never share files
    assert stale_runs(nvme_dir) == [] and remove_stale_runs(nvme_dir) == []  # live runs are locked
    a.close()
    assert len(os.listdir(nvme_dir)) == 1
    del b
    gc.collect()
    assert os.listdir(nvme_dir) == []


def test_files_removed_at_interpreter_exit_and_killed_runs_reported(nvme_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    code = textwrap.dedent(f"""
        import os, signal, torch
        from offload_adam import AdamW
        p = torch.nn.Parameter(torch.randn(1000))
        opt = AdamW([p], offload="nvme", nvme_dir={nvme_dir!r})
        p.grad = torch.randn(1000)
        opt.step()
        if os.environ.get("KILL"):
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert os.listdir(nvme_dir) == []  # normal exit: removed
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "KILL": "1"}, timeout=120)
    left = stale_runs(nvme_dir)
    assert len(left) == 1
    with caplog.at_level(logging.WARNING, logger="offload_adam"):
        opt = AdamW([torch.nn.Parameter(torch.zeros(3))], offload="nvme", nvme_dir=nvme_dir)
    assert any("killed runs" in r.getMessage() and "remove_stale_runs" in r.getMessage() for r in caplog.records)
    assert os.path.isdir(left[0])  # never silently reused or removed
    assert remove_stale_runs(nvme_dir) == left
    opt.close()


def test_free_space_is_checked_before_training(nvme_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import offload_adam.runtime.pages as nvme

    real = nvme.shutil.disk_usage
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OSError, match=r"needs \d+ bytes under .* which has 1000 free"):
        AdamW(_params(), offload="nvme", nvme_dir=nvme_dir)


def _state_file(opt: Any, key: str = "exp_avg") -> str:
    return os.path.join(opt._engine.tier.path, f"group0-{key}.bin")


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_state_file_is_a_clear_error(nvme_dir: str, damage: str) -> None:
    ps = _params()
    a = AdamW(ps, lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB, nvme_read_ahead=0)
    _train(a, ps, range(2))
    before = [p.detach().clone() for p in ps]
    path = _state_file(a)
    if damage == "corrupt":
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"\x7f" * 8)
        match = r"group0-exp_avg\.bin: the state of bucket 0 .* corrupted \(checksum mismatch\)"
    else:
        os.truncate(path, 4096)
        match = r"group0-exp_avg\.bin.*truncated"
    with pytest.raises(OSError, match=match):
        _train(a, ps, range(2, 3))
    assert all(torch.equal(p, q) for p, q in zip(ps, before))  # nothing stepped
    a.close()


# -- faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, err, after", [("read", errno.EIO, 3), ("write", errno.ENOSPC, 2), ("read", errno.EIO, 0)]
)
def test_io_fault_mid_step_then_exact_continuation(io: str, nvme_dir: str, op: str, err: int, after: int) -> None:
    ps, qs = _params(), _params()
    a = AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme_dir, bucket_mb=BUCKET_MB, nvme_read_ahead=1)
    ram = AdamW(_groups(qs), lr=1e-2, bucket_mb=BUCKET_MB)
    _train(a, ps, range(3))
    _train(ram, qs, range(3))
    for p, g in zip(ps, _grads(ps, 3)):
        p.grad = g.clone()
    a._engine.tier.pager.io.inject_fault(op, err, after)
    with pytest.raises(OSError) as info:
        a.step()
    msg = str(info.value)
    assert os.strerror(err) in msg and "bucket" in msg and ".bin" in msg, msg
    assert info.value.errno == err
    a.step()  # the fault is gone (it fires once): the rest of the step is done
    _train(ram, qs, range(3, 4))
    _train(a, ps, range(4, 10))
    _train(ram, qs, range(4, 10))
    _assert_identical(a, ram, ps, qs)
    a.close()


def test_io_fault_in_an_offloaded_step_then_exact_continuation(nvme_dir: str) -> None:
    outs = []
    for fault in (True, False):
        with testing.simulated_device(seed=2, max_delay_s=0.001) as dev:
            torch.manual_seed(0)
            m = Net().to(dev.torch_device)
            opt = AdamW(m.parameters(), lr=1e-2, bucket_mb=0.005, offload="nvme", nvme_dir=nvme_dir, nvme_read_ahead=0)
            g = torch.Generator().manual_seed(5)
            for t in range(8):
                m(torch.randn(8, 32, generator=g).to(dev.torch_device)).square().mean().backward()
                if fault and t == 4:
                    opt._engine.tier.pager.io.inject_fault("read", errno.EIO, 2)
                    with pytest.raises(RuntimeError, match="optimizer step failed") as info:
                        opt.step()
                    assert isinstance(info.value.__cause__, OSError) and "bucket" in str(info.value.__cause__)
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            outs.append([p.detach().cpu() for p in m.parameters()])
            opt.close()
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_sigkill_mid_step_then_resume_from_checkpoint(nvme_dir: str, tmp_path: Any) -> None:
    """A process killed in the middle of a step (SIGKILL: no clean-up runs), resumed from its
    last checkpoint in a new process, continues exactly like an uninterrupted run."""
    script = textwrap.dedent("""
        import os, signal, sys, torch
        sys.path.insert(0, {tests!r})
        from test_nvme import _params, _groups, _train, BUCKET_MB
        from offload_adam import AdamW, testing
        nvme, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
        ps = _params()
        def build():
            return AdamW(_groups(ps), lr=1e-2, offload="nvme", nvme_dir=nvme, bucket_mb=BUCKET_MB)
        if mode == "train":
            with testing.engine_hooks():
                opt = build()
            _train(opt, ps, range(4))
            opt.save_state(ckpt)
            torch.save([p.detach() for p in ps], os.path.join(ckpt, "model.pt"))
            _train(opt, ps, range(4, 6))
            for p, g in zip(ps, [torch.ones_like(p) for p in ps]):
                p.grad = g
            tier = opt._engine.tier
            real = tier.release
            def release(group, slots, copies_done=lambda: None, wrote=True):
                real(group, slots, copies_done, wrote)
                os.kill(os.getpid(), signal.SIGKILL)  # after the first bucket of the step
            tier.release = release
            opt.step()
        else:
            for p, w in zip(ps, torch.load(os.path.join(ckpt, "model.pt"))):
                p.data.copy_(w)
            opt = build()
            opt.load_state(ckpt)
            _train(opt, ps, range(4, 12))
            torch.save([p.detach() for p in ps], os.path.join(ckpt, "final.pt"))
            opt.close()
    """).format(tests=os.path.dirname(__file__))
    ckpt = str(tmp_path / "ckpt")
    run = [sys.executable, "-c", script, nvme_dir, ckpt]
    r = subprocess.run([*run, "train"], timeout=120)
    assert r.returncode == -9
    assert len(stale_runs(nvme_dir)) == 1
    subprocess.run([*run, "resume"], check=True, timeout=120)
    remove_stale_runs(nvme_dir)
    ps = _params()
    ref = AdamW(_groups(ps), lr=1e-2, bucket_mb=BUCKET_MB)
    _train(ref, ps, range(12))
    for p, w in zip(ps, torch.load(os.path.join(ckpt, "final.pt"))):
        assert torch.equal(p, w)


# -- memory ---------------------------------------------------------------------------------------


def test_resident_memory_is_bounded_by_the_window(nvme_dir: str) -> None:
    """32 parameters of 1M elements (256 MB of fp32 moments): the process's peak resident memory
    grows by the window, not by the state (measured in a fresh process); the window's own memory
    (leased and parked) is within it too, the same from step to step, and after a checkpoint that
    made the whole state resident."""
    code = textwrap.dedent("""
        import sys, torch
        from offload_adam import AdamW
        def peak():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        ps = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(32)]
        for p in ps:
            p.grad = torch.randn(1 << 20)
        kw = {"offload": "nvme", "nvme_dir": sys.argv[2]} if sys.argv[1] == "nvme" else {}
        AdamW([torch.nn.Parameter(torch.zeros(1))], **kw).step()  # what the first optimizer imports
        base = rss()
        opt = AdamW(ps, bucket_mb=4, **kw)
        def mappings():
            return sum(1 for _ in open("/proc/self/maps"))
        opt.step()
        first, maps = opt.memory_report().get("window_held_bytes", 0), mappings()
        for _ in range(3):
            opt.step()
        rep, grew, more = opt.memory_report(), peak() - base, mappings() - maps
        opt.state_dict()  # the whole state resident for the duration, then given back
        after = opt.memory_report().get("window_held_bytes", 0)
        print(grew, rep.get("window_bytes", 0), rep.get("nvme_bytes", 0), rep.get("window_held_bytes", 0), first, more,
              after)
    """)
    out = {}
    for tier in ("nvme", "cpu"):
        r = subprocess.run([sys.executable, "-c", code, tier, nvme_dir], capture_output=True, text=True, timeout=300, check=True)
        out[tier] = [int(x) for x in r.stdout.split()]
    state = 32 * (1 << 20) * 4 * 2
    grew, window, on_disk, held, first, more_maps, after_checkpoint = out["nvme"]
    assert on_disk == state
    assert 0 < held <= window
    assert held == first  # the same memory serves every step
    # Its pieces split the buffers' mappings, by at most one more per paged range (32 pages of 2
    # moments each); a cycle of steps brings them back (no growth from step to step).
    assert more_maps <= 64, more_maps
    assert after_checkpoint <= window  # a checkpoint's resident state did not stay parked
    assert out["cpu"][0] >= 0.9 * state  # the measurement sees the state when it is in RAM
    assert grew <= window + (24 << 20), (grew, window)
    assert window <= state // 4


def test_the_memory_window_moves_its_pages_from_range_to_range() -> None:
    """What the pager builds on: window memory moved under a range shows what the last lease
    wrote there; given back, the range reads zeros (an empty mapping) and the window's memory
    serves the next range. Bad arguments are refused by name."""
    from offload_adam.runtime.pages import aligned_empty

    page = 4096 // 4
    a, b = aligned_empty(64 * page, torch.float32), aligned_empty(64 * page, torch.float32)
    w = _native.MemoryWindow()
    la = w.map([a])
    a.copy_(torch.arange(a.numel(), dtype=torch.float32))
    w.unmap(la)
    assert not a.any()  # fresh untouched memory under a
    lb = w.map([b])
    assert torch.equal(b, torch.arange(b.numel(), dtype=torch.float32))  # the same pages, now under b
    assert w.nbytes == b.numel() * 4
    w.unmap(lb)
    assert w.nbytes == b.numel() * 4  # kept for the next lease, not grown
    with pytest.raises(ValueError, match="tensors\\[0\\]: must be contiguous"):
        w.map([a.view(64, page).t()])
    with pytest.raises(ValueError, match="lease: no lease"):
        w.unmap(lb)
    with pytest.raises(TypeError, match="tensors\\[1\\]"):
        w.map([a, "x"])
