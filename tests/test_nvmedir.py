"""A shared ``nvme_dir``: what the run directories' scan may touch (only directories this package
made, never through a symlink, skipping what it cannot lock or read), and what ``close()`` gives
back (every descriptor of the run's files). Everything is written under pytest's temporary
directories."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest

from offload_adam.runtime.pages import LOCK, RUN_PREFIX, RunDir, remove_stale_runs, stale_runs


@pytest.fixture
def nvme_dir(tmp_path: Any) -> Iterator[str]:
    d = str(tmp_path / "nvme")
    os.mkdir(d)
    yield d
    assert [n for n in os.listdir(d) if n.startswith(RUN_PREFIX) and os.path.isdir(os.path.join(d, n))] == [], (
        "run directories left behind"
    )


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
