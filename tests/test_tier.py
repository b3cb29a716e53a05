"""The tier seam: the engine brackets every access to a group's state with `make_resident` and
`release`. A tier that really evicts (the state moved to a side store and the buffers poisoned
with NaN between accesses, as an NVMe tier would page it out) trains exactly like torch, for CPU
groups and offloaded ones, and checkpoints round-trip through it."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from helpers import clone_params, make_params, max_diff, run_twins

from offload_adam import AdamW, testing
from offload_adam.optim.state import GroupState
from offload_adam.optim.tier import HostTier

KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


class EvictingTier(HostTier):
    """Keeps each slot's state in a side store between accesses; the buffers hold NaN then."""

    stable_views = False

    def __init__(self) -> None:
        self.store: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.resident: set[tuple[int, int]] = set()
        self.calls: list[tuple[str, int]] = []

    def _evict(self, group: GroupState, i: int) -> None:
        views = group.views(i)
        self.store[(id(group), i)] = {k: views[k].clone() for k in KEYS if k in views}
        for k in KEYS:
            if k in views:
                views[k].fill_(float("nan"))

    def attach(self, group: GroupState) -> None:
        for i in range(len(group)):
            self._evict(group, i)

    def make_resident(self, group: GroupState, slots: Sequence[int]) -> None:
        self.calls.append(("make_resident", len(slots)))
        for i in slots:
            key = (id(group), i)
            assert key not in self.resident, "made resident twice"
            views = group.views(i)
            for k, v in self.store.pop(key, {}).items():
                if k in views:
                    views[k].copy_(v)
            self.resident.add(key)

    def release(
        self, group: GroupState, slots: Sequence[int], copies_done: Callable[[], None] = lambda: None, wrote: bool = True
    ) -> None:
        self.calls.append(("release", len(slots)))
        copies_done()  # the copy-backs still read the masters
        for i in slots:
            self.resident.remove((id(group), i))
            self._evict(group, i)


@pytest.fixture(params=["direct", "streamed"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "streamed":
        with testing.simulated_device(seed=1, max_delay_s=0.002):  # (make_params puts the parameters there)
            yield request.param
    else:
        yield request.param


class EvictingAdamW(AdamW):
    """AdamW whose state lives in an :class:`EvictingTier` (a copy gets one of its own)."""

    def _make_tier(self, config: dict[str, Any]) -> EvictingTier:
        self.tier = EvictingTier()
        return self.tier


def evicting(**kw: Any) -> tuple[EvictingAdamW, EvictingTier]:
    opt = EvictingAdamW(**kw)
    return opt, opt.tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_through_an_evicting_tier_matches_torch(mode: str, dtype: torch.dtype) -> None:
    ps = make_params(dtype=dtype)
    qs = clone_params(ps, torch.float32)
    ours, tier = evicting(params=ps, lr=1e-3, weight_decay=0.1, amsgrad=True)
    ref = torch.optim.AdamW(qs, lr=1e-3, weight_decay=0.1, amsgrad=True, foreach=False)
    run_twins(ours, ref, ps, qs, 30)
    ours.synchronize()
    for p, q in zip(ps, qs):
        assert max_diff(p.float(), q) <= (2e-5 if dtype == torch.float32 else 1e-2)
    assert not tier.resident  # every access released
    assert {c for c, _ in tier.calls} == {"make_resident", "release"}
    if dtype == torch.float32:
        sd = ours.state_dict()  # made resident for the copy, released after
        assert not tier.resident
        rsd = ref.state_dict()
        for k, v in rsd["state"].items():  # our views read NaN between steps: compare the copies
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                torch.testing.assert_close(sd["state"][k][key].cpu(), v[key].cpu(), rtol=1e-4, atol=1e-7)
            assert float(sd["state"][k]["step"]) == float(v["step"])


def test_checkpoints_round_trip_through_an_evicting_tier(mode: str) -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours, tier = evicting(params=ps, lr=1e-3, amsgrad=True)
    ref = torch.optim.AdamW(qs, lr=1e-3, amsgrad=True, foreach=False)
    run_twins(ours, ref, ps, qs, 5)
    sd = copy.deepcopy(ours.state_dict())
    ref.load_state_dict(copy.deepcopy(sd))
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    ours.state[ps[0]] = copy.deepcopy(ref.state[qs[0]])  # state written by other code, taken over
    run_twins(ours, ref, ps, qs, 5)
    ours.synchronize()
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    twin = copy.deepcopy(ours)  # a copy goes through the tier too
    assert not tier.resident
    assert twin.state_dict()["state"][1]["exp_avg"].isfinite().all()


def test_the_host_tier_is_the_default_and_keeps_views_valid() -> None:
    ps = make_params()
    opt = AdamW(ps)
    assert isinstance(opt._engine.tier, HostTier) and opt._engine.tier.stable_views
    for p in ps:
        p.grad = torch.ones(p.shape)
    opt.step()
    view = opt.state[ps[0]]["exp_avg"]
    assert view.data_ptr() == opt.state_dict()["state"][0]["exp_avg"].data_ptr()  # a view, as torch
