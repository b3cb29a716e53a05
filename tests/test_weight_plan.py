"""The weights' plan (``offload_adam.plan_weights``, ``weights/plan.py``): where every block
lives and runs, printed, edited and built (issue 33, point 1). The plan itself is pure: most of
these tests make one without a device."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing
from offload_adam.weights.plan import BlockPlan, make_plan, ring_bytes

from helpers import to_device, to_host

transformers = pytest.importorskip("transformers")
from test_weights import gpt2, prompt  # noqa: E402

MiB = 1 << 20


def _blocks(layers: int = 4) -> list[BlockPlan]:
    """An embedding, ``layers`` layers of 10 MiB and a head of 20 MiB, as ``describe`` gives them."""
    out = [BlockPlan(0, "embed", 8 * MiB, lookup=True)]
    out += [BlockPlan(1 + i, f"layers.{i}", 10 * MiB, layer=True) for i in range(layers)]
    out.append(BlockPlan(layers + 1, "head", 20 * MiB))
    return out


def test_a_plan_is_made_without_a_device_and_printed() -> None:
    p = make_plan(_blocks(), device="cuda:0", storage="cpu", placement="auto", prefetch=1, gpu_budget=60 * MiB)
    ring = ring_bytes(p.blocks, p.streamed, p.ahead)
    # small blocks first, then layers in order, within the budget after the ring
    assert [b.home for b in p.blocks] == ["device", "device", "ram", "ram", "ram", "device"]
    assert ring == p.ring_bytes == 2 * 10 * MiB  # two general slots: prefetch 1, layers of 10 MiB
    assert p.tier_bytes() == {"device": (8 + 10 + 20) * MiB + ring, "ram": 30 * MiB, "nvme": 0}
    assert p.tier_bytes()["device"] <= 60 * MiB
    assert [b.runs for b in p.blocks] == ["device", "device", "per call", "per call", "per call", "device"]
    text = str(p)
    for b in p.blocks:
        assert any(line.split()[:1] == [b.name] and b.home in line and b.runs in line for line in text.splitlines())
    assert "device ring: 2 slots of 10.00 MiB" in text and "bytes per tier: device" in text
    p.check()  # as made, it fits


def test_nvme_and_the_cpu_as_the_device() -> None:
    p = make_plan(_blocks(), device="cuda:0", storage="nvme", placement="stream", prefetch=1, host_budget=70 * MiB)
    # no gpu budget: every block streamed; the RAM keeps the small blocks, then layers, after its ring
    assert [b.home for b in p.blocks] == ["ram", "ram", "nvme", "nvme", "nvme", "ram"]
    assert p.in_ram == {0, 1, 5} and p.host_ring_slots == 3  # a page copied, one read ahead, one more
    assert p.tier_bytes() == {"device": p.ring_bytes, "ram": (38 + 30) * MiB, "nvme": 30 * MiB}
    cpu = make_plan(_blocks(), device="cpu", storage="nvme", placement="stream", prefetch=1, host_budget=40 * MiB, on_device=False)
    assert cpu.placement == "cpu" and cpu.ring_bytes == 0 and not cpu.in_ram
    assert all(b.runs == "cpu" for b in cpu.blocks) and {b.home for b in cpu.blocks} == {"ram", "nvme"}
    assert cpu.resident == {b.index for b in cpu.blocks if b.home == "ram"}
    with pytest.raises(ValueError, match="host_budget_gb"):
        make_plan(_blocks(), device="cpu", storage="nvme", placement="stream", prefetch=1, host_budget=MiB, on_device=False)


def test_an_edited_plan_that_does_not_fit_names_the_block() -> None:
    p = make_plan(_blocks(), device="cuda:0", storage="cpu", placement="stream", prefetch=1, gpu_budget=60 * MiB)
    p.blocks[3].home = "device"  # one more layer: over the budget
    with pytest.raises(ValueError, match=r"plan: block layers\.2 .*does not fit gpu_budget_gb"):
        p.check()
    p.blocks[3].home = "nvme"  # storage="cpu" has no NVMe
    with pytest.raises(ValueError, match=r"plan: block layers\.2: home 'nvme' is not one of \('device', 'ram'\)"):
        p.check()
    p.blocks[3].home = "ram"
    p.blocks[1].home = "ram"  # a resident layer streamed instead: fits
    p.check()
    assert 2 in p.streamed and p.blocks[1].runs == "device"


def _state(model: torch.nn.Module) -> list[Any]:
    """What must not change: every tensor of the state dict (its values, device, storage), the
    parameters' objects, every module's hooks."""
    out: list[Any] = []
    for n, t in model.state_dict(keep_vars=True).items():
        out.append((n, id(t), type(t), t.device, t.dtype, t.data_ptr() if t.device.type != "meta" else 0, t.detach().clone()))
    for m in model.modules():
        out.append([dict(d) for d in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m.__dict__.get("_parameters", {}))])
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            if x[:6] != y[:6] or not torch.equal(x[6], y[6]):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("quantize", [False, True], ids=["as-is", "quantized"])
def test_plan_weights_changes_nothing(quantize: bool) -> None:
    model = gpt2(torch.float32)
    before = _state(model)
    kw: dict[str, Any] = {"quantize": lambda m: m.half()} if quantize else {}  # (half the bytes: as a quantization)
    with testing.simulated_device(seed=0, max_delay_s=0.0):
        plan = offload_adam.plan_weights(model, gpu_budget_gb=0.0008, prefetch=1, **kw)
    assert _same(before, _state(model))
    assert not hasattr(model, "_offload_adam_weights")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = sum(b.nbytes for b in plan.blocks)
    assert planned < full * 0.6 if quantize else planned >= full  # quantized bytes where quantized (16-byte aligned)


def test_an_edited_plan_is_built_exactly_and_kept_by_the_handle() -> None:
    model = gpt2(torch.float32)
    ref = copy.deepcopy(model)
    x = prompt()
    with torch.no_grad():
        want = ref(x).logits
    with testing.simulated_device(seed=1, max_delay_s=0.001):
        plan = offload_adam.plan_weights(model, gpu_budget_gb=0.0008, prefetch=1)
        layers = [b for b in plan.blocks if b.layer]
        layers[0].home = "device" if layers[0].home == "ram" else "ram"  # edited
        plan.check()
        want_resident = plan.resident
        h = offload_adam.offload_weights(model, plan=plan)
        assert h.plan is plan and h.resident == want_resident
        rep = h.report()
        assert rep["streamed_blocks"] == len(plan.streamed) and rep["prefetch"] == plan.ahead
        assert rep["gpu_resident_bytes"] == sum(plan.blocks[i].nbytes for i in want_resident) + plan.buffer_bytes
        with torch.no_grad():
            got = to_host(model(to_device(x)).logits)
        h.close()
    assert torch.equal(got, want)


def test_a_plan_that_does_not_fit_is_refused_before_anything_changes() -> None:
    model = gpt2(torch.float32)
    before = _state(model)
    with testing.simulated_device(seed=2, max_delay_s=0.0):
        plan = offload_adam.plan_weights(model, gpu_budget_gb=0.0008, prefetch=1)
        streamed = [b for b in plan.blocks if b.home == "ram" and b.layer]
        for b in streamed:
            b.home = "device"
        names = "|".join(b.name.replace(".", "[.]") for b in streamed)  # (the first of them past the budget)
        with pytest.raises(ValueError, match=rf"plan: block ({names}) .*does not fit gpu_budget_gb"):
            offload_adam.offload_weights(model, plan=plan)
        assert _same(before, _state(model))
        with pytest.raises(ValueError, match=r"plan: it holds the arguments it was made with; prefetch given too"):
            offload_adam.offload_weights(model, prefetch=1, plan=offload_adam.plan_weights(model))
        other = offload_adam.plan_weights(gpt2(torch.float32, layers=3))
        with pytest.raises(ValueError, match=r"plan: \d+ blocks, the model has \d+ \(a plan of another model\?\)"):
            offload_adam.offload_weights(model, plan=other)
        assert _same(before, _state(model))
