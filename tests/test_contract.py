"""torch's optimizer contract, as torch's own optimizer tests exercise it: each case against
``torch.optim.AdamW``/``Adam`` behaving the same way."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import assert_state_close, clone_params, make_params, max_diff, run_twins

from offload_adam import AdamW

STREAMING = [False, True]


@pytest.fixture(params=STREAMING, ids=["direct", "streamed"])
def streamed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param:
        monkeypatch.setenv("OFFLOAD_ADAM_FORCE_STREAMING", "1")
    return bool(request.param)


def test_loading_its_own_state_dict_keeps_the_state(streamed: bool) -> None:
    """`opt.load_state_dict(opt.state_dict())`: the sources are views of our own buffers (as with
    torch.distributed.checkpoint, which fills the tensors we handed out, then loads them)."""
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3, amsgrad=True)
    ref = torch.optim.AdamW(qs, lr=1e-3, amsgrad=True, foreach=False)
    run_twins(ours, ref, ps, qs, 10)
    ours.load_state_dict(ours.state_dict())
    assert_state_close(ours, ref, ps, qs)
    run_twins(ours, ref, ps, qs, 10)
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    assert_state_close(ours, ref, ps, qs)


def test_a_source_partly_aliasing_other_slots_loads_correctly(streamed: bool) -> None:
    """Two parameters of one shape exchange their states: each source is a view of the other
    parameter's slot in our buffers."""
    ps = [torch.nn.Parameter(torch.randn(6, 5)) for _ in range(3)]
    ours = AdamW(ps, lr=1e-3)
    for _ in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape)
        ours.step()
    want = copy.deepcopy(ours.state_dict())
    want["state"][0], want["state"][1] = want["state"][1], want["state"][0]
    sd = ours.state_dict()
    sd["state"][0], sd["state"][1] = sd["state"][1], sd["state"][0]
    ours.load_state_dict(sd)
    for i, p in enumerate(ps):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[p][k], want["state"][i][k]), (i, k)
        assert float(ours.state[p]["step"]) == float(want["state"][i]["step"])


def test_betas_loaded_as_a_list_train_on(streamed: bool) -> None:
    """A checkpoint whose betas went through JSON/YAML (or DCP's full state dict) has a list."""
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3, betas=(0.8, 0.99))
    ref = torch.optim.AdamW(qs, lr=1e-3, betas=(0.8, 0.99), foreach=False)
    run_twins(ours, ref, ps, qs, 3)
    for o in (ours, ref):
        sd = copy.deepcopy(o.state_dict())
        sd["param_groups"][0]["betas"] = list(sd["param_groups"][0]["betas"])
        o.load_state_dict(sd)
    run_twins(ours, ref, ps, qs, 5)
    ours.param_groups[0]["betas"] = [0.85, 0.995]  # set by hand, as a list
    ref.param_groups[0]["betas"] = [0.85, 0.995]
    run_twins(ours, ref, ps, qs, 5)
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    assert_state_close(ours, ref, ps, qs)
