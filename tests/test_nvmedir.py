"""A shared ``nvme_dir``: what the run directories' scan may touch (only directories this package
made, never through a symlink, skipping what it cannot lock or read), and what ``close()`` gives
back (every descriptor of the run's files). Everything is written under pytest's temporary
directories."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import AdamW, testing
from offload_adam.runtime.hosted import claimed
from offload_adam.runtime.pages import LOCK, MARKER, RUN_PREFIX, RunDir, remove_stale_runs, stale_runs


@pytest.fixture
def nvme_dir(tmp_path: Any) -> Iterator[str]:
    d = str(tmp_path / "nvme")
    os.mkdir(d)
    yield d
    ours = f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-"
    assert [n for n in os.listdir(d) if n.startswith(ours)] == [], "run directories left behind"


def killed_run(nvme_dir: str) -> str:
    """What a run killed by SIGKILL leaves: its directory, its LOCK unlocked."""
    run = RunDir(nvme_dir)
    detached = run._finalizer.detach()
    assert detached is not None
    path, lock, _ = detached[2]  # (the I/O engine goes with the tuple: its files are closed)
    os.close(lock)
    return str(path)


def test_a_users_folder_named_like_a_run_is_never_removed(nvme_dir: str) -> None:
    """remove_stale_runs took any folder named offload-adam-run-* without a LOCK as a killed run
    (it made the LOCK, locked it, removed the folder): a user's notes were lost. Only a directory
    whose LOCK carries the package's marker is a run's."""
    notes = os.path.join(nvme_dir, RUN_PREFIX + "notes")
    os.mkdir(notes)
    with open(os.path.join(notes, "data.txt"), "w") as f:
        f.write("mine")
    locked = os.path.join(nvme_dir, RUN_PREFIX + "x")  # a user's own folder with a file named LOCK
    os.mkdir(locked)
    with open(os.path.join(locked, LOCK), "w") as f:
        f.write("my lock")
    left = killed_run(nvme_dir)
    assert stale_runs(nvme_dir) == [left]
    assert remove_stale_runs(nvme_dir) == [left]
    assert not os.path.exists(left)
    assert open(os.path.join(notes, "data.txt")).read() == "mine"
    assert os.listdir(notes) == ["data.txt"]  # no LOCK made in it
    assert open(os.path.join(locked, LOCK)).read() == "my lock"
    os.remove(os.path.join(notes, "data.txt"))
    os.rmdir(notes)
    os.remove(os.path.join(locked, LOCK))
    os.rmdir(locked)


# -- the three clients, each making (and removing) a run directory -------------------------------


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def _nothing() -> None:
    pass


# Each takes ``after_close``, called right after ``close()`` while the handle is still referenced.


def use_adamw(nvme_dir: str, after_close: Callable[[], None] = _nothing) -> None:
    p = torch.nn.Parameter(torch.randn(5000))
    opt = AdamW([p], storage="nvme", nvme_dir=nvme_dir)
    p.grad = torch.randn(5000)
    opt.step()
    opt.close()
    after_close()


def use_weights(nvme_dir: str, after_close: Callable[[], None] = _nothing) -> None:
    m = _Blocks()
    x = torch.randn(4, 64)
    want = m(x)
    h = offload_adam.offload_weights(m, device="cpu", storage="nvme", nvme_dir=nvme_dir)
    with torch.no_grad():
        assert torch.equal(m(x), want)
    h.close()
    after_close()


def use_activations(nvme_dir: str, after_close: Callable[[], None] = _nothing) -> None:
    with testing.simulated_device(seed=0, max_delay_s=0.0) as sim:
        m = _Blocks().to(sim.torch_device)  # as a user moves it to "cuda"
        x = torch.randn(64, 64).to(sim.torch_device).requires_grad_()
        with offload_adam.offload_activations(min_bytes=1024, storage="nvme", nvme_dir=nvme_dir, prefetch=0) as ao:
            loss = m(x).sum()
        ao.flush()
        assert ao.report()["write_bytes"] > 0
        loss.backward()
        ao.close()
        after_close()


def use_scan(nvme_dir: str, after_close: Callable[[], None] = _nothing) -> None:
    stale_runs(nvme_dir)
    remove_stale_runs(nvme_dir)


CLIENTS: dict[str, Callable[[str], None]] = {
    "adamw": use_adamw,
    "weights": use_weights,
    "activations": use_activations,
    "remove_stale_runs": use_scan,
}


# -- a shared nvme_dir ----------------------------------------------------------------------------


@pytest.mark.parametrize("client", list(CLIENTS))
def test_symlinks_planted_in_nvme_dir_are_never_followed(client: str, nvme_dir: str, tmp_path: Any) -> None:
    """The scan for killed runs opened <entry>/LOCK with O_CREAT, following symlinks: a link
    named like a run made every run create LOCK in the directory it pointed at, a LOCK that was
    a link created the file it named; and remove_stale_runs reported a link to a killed run's
    directory as removed (rmtree had refused it). Nothing outside nvme_dir may change."""
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, os.path.join(nvme_dir, RUN_PREFIX + "x"))
    os.mkdir(os.path.join(nvme_dir, RUN_PREFIX + "y"))
    os.symlink(victim / "any-name", os.path.join(nvme_dir, RUN_PREFIX + "y", LOCK))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    left = killed_run(str(elsewhere))  # a killed run's directory outside nvme_dir, linked into it
    os.symlink(left, os.path.join(nvme_dir, RUN_PREFIX + "z"))
    CLIENTS[client](nvme_dir)
    assert os.listdir(victim) == []
    assert sorted(os.listdir(left)) == [LOCK]  # neither removed nor locked through the link
    assert stale_runs(nvme_dir) == [] and remove_stale_runs(nvme_dir) == []
    assert sorted(os.listdir(nvme_dir)) == [RUN_PREFIX + "x", RUN_PREFIX + "y", RUN_PREFIX + "z"]
    assert stale_runs(str(elsewhere)) == [left]  # (it is one, where it lies)
    assert remove_stale_runs(str(elsewhere)) == [left]


def test_what_the_scan_cannot_open_read_or_lock_is_skipped(nvme_dir: str, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A LOCK that was a directory stopped every run in the folder (IsADirectoryError); a LOCK
    that is a symlink (to a killed run's LOCK elsewhere), a FIFO, or an entry that is a dangling
    symlink must not be followed, opened for reading (a FIFO blocks) or locked either: each is
    skipped with a debug line, the run goes on, and nothing is removed."""
    odd = {name: os.path.join(nvme_dir, RUN_PREFIX + name) for name in ("lockdir", "locklink", "fifo", "dangling")}
    os.mkdir(odd["lockdir"])
    os.mkdir(os.path.join(odd["lockdir"], LOCK))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    left = killed_run(str(elsewhere))
    os.mkdir(odd["locklink"])
    os.symlink(os.path.join(left, LOCK), os.path.join(odd["locklink"], LOCK))
    os.mkdir(odd["fifo"])
    os.mkfifo(os.path.join(odd["fifo"], LOCK))
    os.symlink(tmp_path / "missing", odd["dangling"])
    with caplog.at_level(logging.DEBUG, logger="offload_adam"):
        assert stale_runs(nvme_dir) == []
        assert remove_stale_runs(nvme_dir) == []
        use_adamw(nvme_dir)
    for path in odd.values():
        assert any(path in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records), path
    assert not any("killed runs" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert sorted(os.listdir(nvme_dir)) == sorted(os.path.basename(p) for p in odd.values())
    assert stale_runs(str(elsewhere)) == [left]
    remove_stale_runs(str(elsewhere))


_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _as_another_user(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own that cannot read a 0700 directory of another user: as
    root, the thread's effective capabilities lose CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
    (capset acts on the calling thread alone, and the thread's credentials end with it: the
    rest of the process keeps its own); as anyone else, nothing to drop."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            if os.geteuid() == 0:
                libc = ctypes.CDLL(None, use_errno=True)
                hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, this thread
                if libc.capget(ctypes.byref(hdr), data) != 0:
                    raise OSError(ctypes.get_errno(), "capget")
                data[0].effective &= ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH))
                if libc.capset(ctypes.byref(hdr), data) != 0:
                    raise OSError(ctypes.get_errno(), "capset")
            out["result"] = fn()
        except BaseException as e:  # (raised again on the test's thread)
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_another_users_run_directory_is_skipped(nvme_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """User B's scan of user A's live run directory (0700) got PermissionError on its LOCK, and
    B's AdamW(storage="nvme") failed. As root, the directory is given to uid 65534 and the scan
    runs on a thread without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (as in the report, where
    setpriv dropped them); as another user, the directory is the test's own with mode 0."""
    other = os.path.join(nvme_dir, RUN_PREFIX + "otherhost-4242-abcdef12")
    os.mkdir(other, 0o700)
    with open(os.open(os.path.join(other, LOCK), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(MARKER)
    root = os.geteuid() == 0
    if root:
        os.chown(os.path.join(other, LOCK), 65534, 65534)
        os.chown(other, 65534, 65534)
    else:
        os.chmod(other, 0)
    try:

        def scan_and_run() -> tuple[list[str], list[str], bool]:
            readable = os.access(other, os.R_OK | os.X_OK, effective_ids=True)
            stale, removed = stale_runs(nvme_dir), remove_stale_runs(nvme_dir)
            use_adamw(nvme_dir)
            return stale, removed, readable

        with caplog.at_level(logging.DEBUG, logger="offload_adam"):
            stale, removed, readable = _as_another_user(scan_and_run)
        assert not readable  # the case is the one reported: the directory cannot be entered
        assert stale == [] and removed == []
        assert any(other in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    finally:
        os.chmod(other, 0o700)
    assert os.listdir(other) == [LOCK]
    os.remove(os.path.join(other, LOCK))
    os.rmdir(other)


def test_the_lock_is_0600_and_the_run_private_under_umask_0(nvme_dir: str) -> None:
    """The LOCK was 0644 (0666 under umask 0) inside the 0700 run directory; the data files
    and the directory were private already."""
    old = os.umask(0)
    try:
        run = RunDir(nvme_dir)
        run.open("data.bin", 4096)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(run.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(run.path, LOCK)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(run.path, "data.bin")).st_mode) == 0o600
    run.close()


# -- the disk given back at close() ---------------------------------------------------------------


def open_under(nvme_dir: str) -> list[str]:
    """The files under ``nvme_dir`` this process holds open (``... (deleted)`` once removed)."""
    root = os.path.realpath(nvme_dir) + os.sep
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the descriptor listdir itself used)
            continue
        if link.startswith(root):
            out.append(link)
    return out


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Nothing is closed by the cycle collector behind the test's back: what close() does not
    close stays open."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("client", ["adamw", "weights", "activations"])
def test_close_closes_every_file_of_the_run(client: str, nvme_dir: str, no_gc: None) -> None:
    """close() removed the run directory but the I/O engine kept its descriptors until the
    handle was garbage-collected (it sits in reference cycles): the space of the removed files
    was not given back (weights.bin (deleted), group0-exp_avg.bin (deleted) in /proc/self/fd)."""
    seen: list[list[str]] = []

    def after_close() -> None:
        seen.append(open_under(nvme_dir))

    CLIENTS[client](nvme_dir, after_close)
    assert seen == [[]]
    assert os.listdir(nvme_dir) == []


def test_the_engine_refuses_use_after_close(tmp_path: Any) -> None:
    run = RunDir(str(tmp_path))
    fid, _ = run.open("a.bin", 4096)
    run.close()
    assert run.io.closed and not os.path.exists(run.path)
    with pytest.raises(RuntimeError, match="the I/O engine is closed"):
        run.io.submit([(True, fid, torch.zeros(4096, dtype=torch.uint8), 0)])
    with pytest.raises(RuntimeError, match="the I/O engine is closed"):
        run.io.open(str(tmp_path / "b.bin"), 4096)
    assert os.listdir(tmp_path) == []
    run.close()  # a second close: nothing


def test_a_failed_run_set_up_removes_what_it_made(nvme_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run directory and its LOCK were made before the I/O engine; when that failed (a bad
    OFFLOAD_ADAM_IO), they stayed, and the next run reported them as a killed run's."""
    monkeypatch.setenv("OFFLOAD_ADAM_IO", "bogus")
    with pytest.raises(ValueError, match="OFFLOAD_ADAM_IO must be 'uring' or 'threads'"):
        RunDir(nvme_dir)
    assert os.listdir(nvme_dir) == [] and open_under(nvme_dir) == []


def _arm_allocation_fault(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """Every run directory made from now on fails the allocation of its file number ``after``
    (0: the first) with ENOSPC, as posix_fallocate on a full disk."""
    real = RunDir.__init__

    def init(self: RunDir, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.io.inject_fault("open", errno.ENOSPC, after)

    monkeypatch.setattr(RunDir, "__init__", init)


def _train(opt: Any, ps: list[torch.nn.Parameter], steps: int) -> None:
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_a_failed_nvme_optimizer_set_up_changes_nothing_and_removes_what_it_made(
    nvme_dir: str, no_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed AdamW(storage="nvme") (its second file could not be allocated) kept the file it
    had allocated, open, until a full garbage collection (free space 4194304 -> 1794048 on a 4
    MiB tmpfs), and left its parameters claimed: offload_weights then refused the model."""
    m = _Blocks()
    before = [p.detach().clone() for p in m.parameters()]
    _arm_allocation_fault(monkeypatch, 1)
    with pytest.raises(OSError, match=r"cannot allocate \d+ bytes for .*group0-exp_avg_sq\.bin: No space left on device") as info:
        AdamW(m.parameters(), storage="nvme", nvme_dir=nvme_dir)
    # (checked while the error, and so its traceback, is alive: as in the caller's except block)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(nvme_dir) == [] and open_under(nvme_dir) == []
    assert all(claimed(p) is None for p in m.parameters())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    monkeypatch.undo()
    h = offload_adam.offload_weights(m, device="cpu", storage="nvme", nvme_dir=nvme_dir)  # refused while claimed
    h.close()


def test_a_failed_param_group_leaves_the_nvme_optimizer_as_it_was(nvme_dir: str, no_gc: None) -> None:
    """add_param_group on an NVMe optimizer whose new files cannot be allocated: its error, and
    the optimizer as it was (its files, its groups, its steps: bitwise the one never asked)."""
    ps = [torch.nn.Parameter(torch.randn(3000)), torch.nn.Parameter(torch.randn(700))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = AdamW([ps[0]], storage="nvme", nvme_dir=nvme_dir, lr=1e-2)
    ref = AdamW([qs[0]], lr=1e-2)
    _train(opt, ps[:1], 2)
    _train(ref, qs[:1], 2)
    files = sorted(os.listdir(opt._engine.tier.path))
    held = sorted(open_under(nvme_dir))
    opt._engine.tier.store.io.inject_fault("open", errno.ENOSPC, 1)
    with pytest.raises(OSError, match="No space left on device"):
        opt.add_param_group({"params": [ps[1]]})
    assert sorted(os.listdir(opt._engine.tier.path)) == files
    assert sorted(open_under(nvme_dir)) == held
    assert len(opt.param_groups) == 1 and claimed(ps[1]) is None
    opt.add_param_group({"params": [ps[1]]})  # the disk has room again
    ref.add_param_group({"params": [qs[1]]})
    _train(opt, ps, 3)
    _train(ref, qs, 3)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    opt.close()
    assert open_under(nvme_dir) == []


# -- save_state's temporary file ------------------------------------------------------------------


def test_a_killed_save_states_temporary_file_is_removed_by_the_next(tmp_path: Any) -> None:
    """A run killed during save_state left optimizer.safetensors.tmp-<pid>, which no later run
    removed. The next save_state removes such files, and only those: not another name, not a
    symlink, not the file of a writer at work (its lock held)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ps = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(7))]
    opt = AdamW(ps, lr=1e-2)
    _train(opt, ps, 2)
    killed = ckpt / "optimizer.safetensors.tmp-999999"
    killed.write_bytes(b"half a checkpoint")
    others = [ckpt / n for n in ("optimizer.safetensors.tmp-abc", "optimizer.safetensors.tmp-", "notes.tmp-123")]
    for o in others:
        o.write_text("mine")
    target = tmp_path / "target"
    target.write_text("elsewhere")
    link = ckpt / "optimizer.safetensors.tmp-777777"
    os.symlink(target, link)
    live = ckpt / "optimizer.safetensors.tmp-888888"  # another process writing now: its lock held
    with open(live, "wb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        opt.save_state(str(ckpt))
    assert not killed.exists()
    assert all(o.read_text() == "mine" for o in others)
    assert os.path.islink(link) and target.read_text() == "elsewhere"
    assert live.exists()
    assert sorted(os.listdir(ckpt)) == sorted(
        ["optimizer.safetensors", live.name, link.name, *(o.name for o in others)]
    )  # (its own temporary file renamed)
    fresh = AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2)
    fresh.load_state(str(ckpt))
    for a, b in zip(opt.state_dict()["state"].values(), fresh.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
