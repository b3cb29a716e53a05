"""The handles explain themselves (issue 37, point 4): ``repr`` and ``summary()`` of an offload
of weights and of the optimizer name what applies and nothing else, and ``report()``'s byte
counts are ints."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing

from test_bad_input import _Layers, nvme_dir  # noqa: F401 (nvme_dir: a fixture)


def _byte_counts_are_ints(rep: dict[str, Any]) -> None:
    counts = {k: v for k, v in rep.items() if k.endswith("_bytes")}
    assert counts and all(type(v) is int for v in counts.values()), {k: type(v).__name__ for k, v in counts.items()}


def test_weights_on_the_cpu_from_nvme_say_what_they_hold_and_did(nvme_dir: str) -> None:
    """The CPU as the device: no VRAM anywhere; the forwards counted (the report said 0 passes,
    "over 0 forwards", after forwards that read the SSD); read_bytes an int (it was a float);
    no per-forward figures or block calls before a forward."""
    model = _Layers(4)
    h = offload_adam.offload_weights(model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=1)
    try:
        r = repr(h)
        assert r.startswith("<WeightOffload storage='nvme' device='cpu' placement='cpu': 4 blocks, 4 streamed, prefetch 1")
        assert "NVMe " in r and "RAM ring " in r and "VRAM" not in r
        quiet = h.summary()
        assert "VRAM" not in quiet and "per forward" not in quiet and "block calls" not in quiet
        assert "storage nvme, device cpu (the CPU runs the model)" in quiet
        for _ in range(3):
            model(torch.randn(2, 32))
        rep = h.report()
        _byte_counts_are_ints(rep)
        assert rep["passes"] == 3 and rep["read_bytes"] == 3 * rep["nvme_bytes"]  # every block read once per forward
        s = h.summary(ttft_s=0.5, tokens_per_s=4.0, read_gbs=2.0)
        assert "VRAM" not in s and "over 3 forwards" in s and "read from the SSD" in s
        assert "time to first token 500.0 ms, 4.00 tokens/s" in s
        assert "block calls: prompt 12 on the CPU" in s and "streamed" not in s.split("block calls:")[1]
        assert "bound: O_DIRECT read rate (measured by the caller) 2.00 GB/s" in s
        h.reset_stats()
        assert "over" not in h.summary() and "block calls" not in h.summary()
    finally:
        h.close()
    assert repr(h).startswith("<WeightOffload closed; storage='nvme'")


def test_weights_on_a_device_show_vram_and_what_crossed() -> None:
    model = _Layers(4)
    with testing.simulated_device(max_delay_s=0.0):
        h = offload_adam.offload_weights(model, prefetch=1)
        try:
            assert "VRAM resident" in repr(h) and "VRAM ring" in repr(h) and "pinned RAM" in repr(h)
            for _ in range(2):
                model(torch.randn(2, 32, device=h.device.torch_device))
            rep = h.report()
            _byte_counts_are_ints(rep)
            assert rep["passes"] == 2  # (it read 0 at inference: the streamer counts cycles a backward ends)
            s = h.summary()
            assert "VRAM: peak of the offload" in s and "host to device, over 2 forwards" in s and "NVMe" not in s
        finally:
            h.close()


def test_the_optimizer_says_its_state_tiers_and_dtypes(nvme_dir: str) -> None:
    model = _Layers(2)
    opt = offload_adam.AdamW(model.parameters(), state_dtype=torch.bfloat16)
    assert repr(opt) == (
        f"<AdamW storage='cpu': 4 tensors, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"moments bfloat16, masters the parameters themselves; host {offload_adam.runtime.units.size(opt.memory_report()['host_bytes'])}>"
    )
    s = opt.summary()
    assert "1 group, 4 tensors" in s and "state: moments bfloat16" in s and "storage cpu: RAM" in s
    assert "NVMe" not in s and "GPU" not in s
    ssd = offload_adam.AdamW(model.parameters(), storage="nvme", nvme_dir=nvme_dir, state_dtype=torch.uint8)
    try:
        assert "storage='nvme'" in repr(ssd) and "NVMe " in repr(ssd) and "8-bit blocks" in repr(ssd)
        assert f"NVMe: {offload_adam.runtime.units.size(ssd.memory_report()['nvme_bytes'])} of state under {nvme_dir}" in ssd.summary()
    finally:
        ssd.close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_fill_shows_a_bar_over_its_blocks_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """Offloading a checkpoint of GBs took minutes without a word: a tqdm bar over the blocks
    appears on a terminal once the fill has run progress.DELAY_S (0 here); with stderr not a
    terminal (a test, a log file) nothing is printed."""
    from offload_adam.weights import progress

    model = _Layers(4)
    offload_adam.offload_weights(model, device="cpu").close()
    assert capsys.readouterr().err == ""
    term = _Terminal()
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(sys, "stderr", term)
    offload_adam.offload_weights(model, device="cpu").close()
    assert "offload_weights: filling blocks" in term.getvalue() and "/4 [" in term.getvalue()  # (its total: the 4 blocks)


def test_the_repr_of_an_optimizer_not_set_up_says_so() -> None:
    """A traceback or a debugger shows ``self`` of a set-up that raised half-way (before the
    param groups): its repr must not raise in turn."""
    half = offload_adam.AdamW.__new__(offload_adam.AdamW)
    assert repr(half) == "<AdamW: not set up>"
