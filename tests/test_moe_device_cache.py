"""The device's expert cache (issue 34, point 4; ``experts.DeviceCache``), on the simulated device:
bitwise the resident eager model for a cache of a few units (evicting) as for one of all; each
copy is one miss and moves its expert's unit only; a miss is copied or computed on the host as the
cost model prices it, with rates the test sets. (No cache, ``gpu_budget_gb`` not given, and a
cache of all units: test_moe.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing
from offload_adam.runtime.pinned import align_up
from offload_adam.weights.blocks import TENSOR_ALIGN
from offload_adam.weights.costs import CostModel

from helpers import to_device
from test_moe import RowsModel, model, prompt, reference, run, same
from test_weights import nvme_dir  # noqa: F401 (a fixture: a temporary directory, left empty)

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def unit(m: torch.nn.Module) -> int:
    """One expert's slot on the device: its unit's bytes on the tensor alignment."""
    from offload_adam.weights.experts import find_experts

    return max(align_up(lay.unit_bytes, TENSOR_ALIGN) for lay in find_experts(m))


def budget_for(m: torch.nn.Module, slots: int, **kw: Any) -> float:
    """The gpu_budget_gb whose device tier keeps every dense block resident and leaves
    ``slots`` expert slots (and half of one more)."""
    want = int((slots + 0.5) * unit(m))
    p = offload_adam.plan_weights(m, gpu_budget_gb=1.0, **kw)
    budget = (p.tier_bytes()["device"] + want) / 2**30  # (GiB)
    for _ in range(3):  # (the plan's device tier depends on the budget given: its ring)
        p = offload_adam.plan_weights(m, gpu_budget_gb=budget, **kw)
        budget += (want - (p.gpu_budget - p.tier_bytes()["device"])) / 2**30
    return budget


def count_copies(h: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every copy into one of the device cache's slots, as they are made."""
    gpu = h.experts.gpu
    slots = {s.untyped_storage().data_ptr() for s in gpu.slots}
    dev = gpu.device
    real = dev.copy_blocking
    copies: list[int] = []

    def copy_blocking(pairs: Any, stream: Any) -> None:
        for dst, src in pairs:
            if dst.untyped_storage().data_ptr() in slots:
                copies.append(src.numel() * src.element_size())
        real(pairs, stream)

    monkeypatch.setattr(dev, "copy_blocking", copy_blocking)
    return copies


def routed_per_call(m: torch.nn.Module) -> list[tuple[int, set[int]]]:
    """Each experts call's (module number, the experts it routed to), as they are made."""
    calls: list[tuple[int, set[int]]] = []
    mods = [x for x in m.modules() if hasattr(x, "has_gate") and hasattr(x, "num_experts")]
    for i, x in enumerate(mods):

        def pre(mod: Any, args: Any, i: int = i) -> None:
            idx = args[1].cpu() if args[1].device.type != "cpu" else args[1]  # (test-side: the device's own copy)
            calls.append((i, {int(e) for e in idx.flatten().tolist() if 0 <= e < mod.num_experts}))

        x.register_forward_pre_hook(pre)
    return calls


@pytest.mark.parametrize("arch,placement,storage", [("qwen3moe", "stream", "cpu"), ("deepseek_v3", "auto", "nvme"), ("mixtral", "stream", "nvme")])
def test_a_small_device_cache_is_bitwise_the_eager_experts_loop(arch: str, placement: str, storage: str, nvme_dir: str) -> None:
    """A device cache of 3 units (of 16 to 48: every call evicts), the dense blocks resident:
    logits and 24 greedy tokens bitwise the resident eager model's, no ordering violation (a copy
    into an evicted slot waits for the compute that read it)."""
    m = model(arch)
    want = reference(arch)
    kw: dict[str, Any] = {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    with testing.simulated_device(seed=4, max_delay_s=0.001) as sim:
        budget = budget_for(m, 3)
        h = offload_adam.offload_weights(
            m, placement=placement, storage=storage, gpu_budget_gb=budget, native_matmul=False, **kw,
            **({"cost_model": RowsModel()} if placement == "auto" else {}),
        )  # fmt: skip
        assert h.report()["expert_gpu_units"] == 3
        assert same(run(m, prompt()), want)
        ph = h.report()["experts"]
        h.close()
    assert sim.violations == []
    assert sum(p["copied"] for p in ph.values()) > h.report()["expert_units"] // 2  # (evicted, copied again)


@pytest.mark.parametrize("slots", [3, None], ids=["small", "all"])
def test_each_copy_to_the_device_is_one_miss_of_one_units_bytes(slots: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per token (a prompt, then 6 decode steps), the copies into the device cache are its misses:
    the experts routed (counted from the router's top_k_index) less the cache's hits, each copy
    one expert's unit, no more bytes. With a cache of all units each expert is copied once, at
    its first use: per token, the (layer, expert) pairs not routed before."""
    m = model("qwen3moe")
    calls = routed_per_call(m)
    with testing.simulated_device(seed=1, max_delay_s=0.0):
        budget = budget_for(m, slots if slots is not None else 10**4)
        h = offload_adam.offload_weights(m, placement="stream", storage="cpu", gpu_budget_gb=budget, native_matmul=False)
        total = h.report()["expert_units"]
        assert h.report()["expert_gpu_units"] == (slots if slots is not None else total)
        copies = count_copies(h, monkeypatch)
        unit_bytes = {lay.unit_bytes for lay in h.experts.layouts}
        seen: set[tuple[int, int]] = set()
        x = to_device(prompt())
        past = None
        with torch.no_grad():
            for step in range(7):
                h.reset_stats()
                del calls[:], copies[:]
                out = m(x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                x = out.logits[:, -1:].argmax(-1)
                ph = h.report()["experts"]["prompt" if step == 0 else "decode"]
                routed = sum(len(es) for _, es in calls)
                assert ph["experts"] == routed and ph["copied"] == routed - ph["gpu_hits"] == len(copies), (step, ph, routed, copies)
                assert set(copies) <= unit_bytes
                new = {(i, e) for i, es in calls for e in es} - seen
                seen |= new
                if slots is None:
                    assert len(copies) == len(new), (step, len(copies), len(new))
        h.close()


class _Recorder(CostModel):
    """The cost model with the rates a test sets, recording each expert's choice."""

    choices: list[tuple[int, int, str]] = []  # (bytes, rows, choice) of calls for a unit's bytes
    units: set[int] = set()

    def choose(self, nbytes: int, params: int, rows: int, dtype: torch.dtype) -> str:
        out = super().choose(nbytes, params, rows, dtype)
        if nbytes in self.units:
            self.choices.append((nbytes, rows, out))
        return out


def test_a_miss_is_copied_or_computed_on_the_host_as_the_cost_model_prices_it() -> None:
    """Rates set so that an expert's host compute of ``rows`` rows (2 x params x rows at 1.5
    GFLOP/s, no crossing cost, reading unbounded) costs less than its copy (its bytes at 1 GB/s)
    only for one row: a miss of one row is computed on the host, of two or more copied; the
    report's counts are the cost model's answers; bitwise the resident eager model."""
    m = model("qwen3moe")
    want = reference("qwen3moe")
    rates = {"bfloat16": {"1": 1.5, "64": 1.5}}
    cm = _Recorder(host_read_gbs=1e6, pcie_h2d_gbs=1.0, cpu_gflops=rates, crossing_us=0.0)
    _Recorder.choices = []
    with testing.simulated_device(seed=2, max_delay_s=0.001) as sim:
        budget = budget_for(m, 10**4, placement="auto", cost_model=cm)
        h = offload_adam.offload_weights(m, placement="auto", storage="cpu", gpu_budget_gb=budget, native_matmul=False, cost_model=cm)
        _Recorder.units = {lay.unit_bytes for lay in h.experts.layouts}
        assert same(run(m, prompt()), want)
        ph = h.report()["experts"]
        h.close()
    assert sim.violations == []
    choices = _Recorder.choices
    assert {c for _, _, c in choices} == {"cpu", "stream"}, choices  # (the rates give both answers)
    assert all((c == "cpu") == (rows == 1) for _, rows, c in choices), choices
    assert sum(p["cpu_computed"] for p in ph.values()) == sum(c == "cpu" for _, _, c in choices)
    assert sum(p["copied"] for p in ph.values()) == sum(c == "stream" for _, _, c in choices)


# -- a prompt streams its experts whole --------------------------------------------------------------


@pytest.mark.parametrize("arch,storage,slots", [("qwen3moe", "cpu", 3), ("deepseek_v3", "nvme", 3), ("mixtral", "cpu", 10_000)])
def test_a_prompt_streams_its_experts_through_two_buffers_bitwise(
    arch: str, storage: str, slots: int, nvme_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of more than STREAM_ROWS rows on the device (the prompt, here of 8 rows with the
    threshold at 1) runs its experts from the device cache or streamed whole through two device
    buffers, the next copied while the current computes: logits and 24 greedy tokens bitwise the
    resident eager model's, no ordering violation (each copy after the compute that read its
    buffer, each compute after its copy, over a delayed simulated device)."""
    from offload_adam.weights import experts as experts_mod

    monkeypatch.setattr(experts_mod, "STREAM_ROWS", 1)
    m = model(arch)
    want = reference(arch)
    kw: dict[str, Any] = {"nvme_dir": nvme_dir} if storage == "nvme" else {}
    with testing.simulated_device(seed=5, max_delay_s=0.002) as sim:
        h = offload_adam.offload_weights(m, storage=storage, gpu_budget_gb=budget_for(m, slots), native_matmul=False, **kw)
        assert same(run(m, prompt()), want)
        ph = h.report()["experts"]
        summary = h.summary()
        h.close()
    assert sim.violations == []
    assert f"streamed {ph['prompt']['streamed']}" in summary
    assert ph["prompt"]["streamed"] > 0 and ph["decode"]["streamed"] == 0
    assert ph["prompt"]["streamed"] + ph["prompt"]["gpu_hits"] == ph["prompt"]["experts"] and ph["prompt"]["copied"] == 0
