"""torch's optimizer contract, as torch's own optimizer tests exercise it: each case against
``torch.optim.AdamW``/``Adam`` behaving the same way."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_state_close, clone_params, make_params, max_diff, run_twins, to_device

import offload_adam
from offload_adam import AdamW, testing

STREAMING = [False, True]


@pytest.fixture(params=STREAMING, ids=["direct", "streamed"])
def streamed(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Streamed: the parameters on a simulated device without delays whose waits are immediate
    (torch's optimizer, the reference, on the same parameters' twins there)."""
    with testing.simulated_device(max_delay_s=0.0, lazy=False) if request.param else contextlib.nullcontext():
        yield bool(request.param)


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
    ps = [torch.nn.Parameter(to_device(torch.randn(6, 5))) for _ in range(3)]
    ours = AdamW(ps, lr=1e-3)
    for _ in range(4):
        for p in ps:
            p.grad = to_device(torch.randn(p.shape))
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


def test_a_state_dict_held_while_training_goes_on_stays_consistent(streamed: bool) -> None:
    """torch's `state_dict()` entries are the very dicts `opt.state` holds, whose tensors (step
    included) are the live state: a state dict held while training continues shows one
    consistent step (moments of step 5 with a step count of 5), as torch's. Ours used to hand
    out live moments beside a frozen step count: moments of step 5 with step 3."""
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
    run_twins(ours, ref, ps, qs, 3)
    held = {"ours": ours.state_dict(), "torch": ref.state_dict()}
    run_twins(ours, ref, ps, qs, 2)
    for name, opt, params in (("ours", ours, ps), ("torch", ref, qs)):
        sd = held[name]
        for i, p in enumerate(params):
            if p not in opt.state:
                continue
            assert sd["state"][i] is opt.state[p], name  # the same entry object
            assert float(sd["state"][i]["step"]) == 5.0, name
            assert torch.equal(sd["state"][i]["exp_avg"], opt.state[p]["exp_avg"]), name
    for i in held["torch"]["state"]:
        a, b = held["ours"]["state"][i], held["torch"]["state"][i]
        torch.testing.assert_close(a["exp_avg"].cpu(), b["exp_avg"].cpu(), rtol=1e-4, atol=1e-7)


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


def test_state_written_by_other_code_is_taken_over(streamed: bool) -> None:
    """`opt.state[p] = {...}` (as ZeroRedundancyOptimizer.load_state_dict does) or an entry
    replaced by a new tensor is copied into our buffers at the next step, never ignored."""
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3, amsgrad=True)
    ref = torch.optim.AdamW(qs, lr=1e-3, amsgrad=True, foreach=False)
    run_twins(ours, ref, ps, qs, 5)
    # Another optimizer's state, written entry by entry and tensor by tensor.
    donor = torch.optim.AdamW(clone_params(qs), lr=1e-3, amsgrad=True, foreach=False)
    run_twins(donor, torch.optim.AdamW(clone_params(qs), lr=1e-3, amsgrad=True), donor.param_groups[0]["params"], clone_params(qs), 3)
    for p, q, d in zip(ps, qs, donor.param_groups[0]["params"]):
        if d in donor.state:
            ref.state[q] = copy.deepcopy(donor.state[d])
            ours.state[p] = copy.deepcopy(donor.state[d])
    ref.state[qs[2]]["exp_avg"] = ref.state[qs[2]]["exp_avg"] * 2
    ours.state[ps[2]]["exp_avg"] = ours.state[ps[2]]["exp_avg"] * 2
    del ref.state[qs[3]]  # a fresh start for this one
    del ours.state[ps[3]]
    run_twins(ours, ref, ps, qs, 5)
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    assert_state_close(ours, ref, ps, qs)
    assert float(ours.state[ps[3]]["step"]) == 5


def test_copies_of_an_optimizer_step_on_their_own(streamed: bool, tmp_path: Any) -> None:
    """`copy.deepcopy(opt)` (with a deep copy of its model, as torch's tests do) and
    `torch.save(opt)`/`torch.load(..., weights_only=False)` give optimizers that own their own
    host buffers and step identically to the original."""
    torch.manual_seed(0)
    model = to_device(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)))
    opt = AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    x = to_device(torch.randn(9, 5))

    def train(m: torch.nn.Module, o: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()

    train(model, opt, 3)
    model2, opt2 = copy.deepcopy((model, opt))
    torch.save((model, opt), tmp_path / "opt.pt")
    model3, opt3 = torch.load(tmp_path / "opt.pt", weights_only=False)
    for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
        train(m, o, 4)
    for m in (model2, model3):
        for p, q in zip(model.parameters(), m.parameters()):
            assert torch.equal(p, q)
    for o in (opt2, opt3):
        a, b = opt.state_dict()["state"][0], o.state_dict()["state"][0]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and float(a["step"]) == float(b["step"]) == 7
        assert a["exp_avg"].data_ptr() != b["exp_avg"].data_ptr()


def test_state_dict_whatever_state_holds(streamed: bool) -> None:
    """Reading `opt.state[p]` before p's first step (a defaultdict) leaves an empty entry; a
    state_dict pre-hook may store extra entries or non-dict values: carried as torch does."""
    outs = []
    for cls in (AdamW, torch.optim.AdamW):
        ps = make_params()
        opt = cls(ps, lr=1e-3)
        _ = opt.state[ps[0]]  # before any step
        opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("extra", 1))
        for p in ps[1:]:
            p.grad = to_device(torch.randn(p.shape))
        opt.step()
        sd = opt.state_dict()
        outs.append(sd)
        assert sd["state"][0] == {} and sd["state"]["extra"] == 1
        opt.load_state_dict(copy.deepcopy(sd))
        assert opt.state["extra"] == 1
    assert set(outs[0]["state"]) == set(outs[1]["state"])


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"lr": torch.tensor(1e-3), "foreach": True}, "lr as a Tensor is not supported for capturable=False and foreach=True"),
        ({"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True}, r"betas\[0\] as a Tensor is not supported"),
        ({"betas": (0.9, torch.tensor(0.99))}, "betas must be either both floats or both Tensors"),
        ({"fused": True, "foreach": True}, "`fused` and `foreach` cannot be `True` together"),
    ],
)
def test_validation_as_torch(kw: dict[str, Any], msg: str) -> None:
    for cls in (torch.optim.AdamW, AdamW):
        with pytest.raises((ValueError, RuntimeError), match=msg):
            cls(make_params(), **kw)


def test_tensor_betas_train_like_torch(streamed: bool) -> None:
    ps = make_params()
    qs = clone_params(ps)
    betas = (torch.tensor(0.8), torch.tensor([0.99]))
    ours = AdamW(ps, lr=torch.tensor(1e-3), betas=betas)
    ref = torch.optim.AdamW(qs, lr=torch.tensor(1e-3), betas=betas, foreach=False)
    assert ours.param_groups[0]["betas"][1].dim() == 0  # torch's _to_scalar
    run_twins(ours, ref, ps, qs, 10)
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5


def test_a_subclass_of_adamw_keeps_decoupled_weight_decay_when_loading_adam_state() -> None:
    class MyAdamW(AdamW):
        pass

    ps = make_params()
    adam = torch.optim.Adam(clone_params(ps), lr=1e-3, weight_decay=0.1)
    sd = adam.state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    for cls in (MyAdamW, torch.optim.AdamW):
        o = cls(clone_params(ps), lr=1e-3, weight_decay=0.1)
        o.load_state_dict(copy.deepcopy(sd))
        assert o.param_groups[0]["decoupled_weight_decay"] is True, cls


def test_a_replaced_storage_of_the_same_shape_is_rebound(streamed: bool) -> None:
    """`p.data = t` (same shape and dtype): the optimizer trains the new storage, keeps the
    state, and never writes the old one; a new shape is a clear error before anything changes."""
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
    run_twins(ours, ref, ps, qs, 3)
    old = ps[0].detach()
    kept = old.clone()
    new = to_device(torch.randn(ps[0].shape))
    ps[0].data = new.clone()
    qs[0].data = new.clone()
    run_twins(ours, ref, ps, qs, 3)
    assert torch.equal(old, kept)
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    assert_state_close(ours, ref, ps, qs)
    ps[1].data = to_device(torch.randn(3))  # a new shape
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = to_device(torch.randn(p.shape))
    with pytest.raises(RuntimeError, match=r"changed|replaced"):
        ours.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))


def test_a_model_built_on_the_meta_device_then_materialized(streamed: bool) -> None:
    """The optimizer built over meta-device parameters, then `to_empty()` with swapped
    parameters (the Parameter objects survive), as torch's own optimizer then trains on."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        outs = []
        for cls in (AdamW, torch.optim.AdamW):
            with torch.device("meta"):
                m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
            opt = cls(m.parameters(), lr=1e-2)
            m.to_empty(device=to_device(torch.empty(0)).device)  # the simulated device when streamed
            torch.manual_seed(0)
            for mod in m:
                mod.reset_parameters()
            x = to_device(torch.randn(5, 4))
            for _ in range(5):
                opt.zero_grad()
                m(x).pow(2).mean().backward()
                opt.step()
            outs.append([p.detach().clone() for p in m.parameters()])
        for a, b in zip(*outs):
            assert max_diff(a, b) <= 2e-5
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _strided(t: torch.Tensor) -> torch.nn.Parameter:
    """A parameter that is a strided view, not dense in memory (torch's test_optim makes them
    with ``[..., 0]`` of a 3-d tensor): shape (10, 5), strides (10, 2)."""
    base = torch.empty(*t.shape, 2, dtype=t.dtype)
    p = torch.nn.Parameter(base[..., 0])
    with torch.no_grad():
        p.copy_(t)
    return p


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_strided_parameter_is_stepped_as_torch_steps_it(amsgrad: bool) -> None:
    """A parameter that is not dense in memory was refused; torch steps it (4 errors of torch's
    test_optim, test_forloop_goes_right_direction with contiguous=False). It is stepped through a
    contiguous stand-in written back after each step, in place: the parameter keeps its storage."""
    torch.manual_seed(0)
    init = [torch.randn(10, 5), torch.randn(7, 3)]
    ps = [_strided(init[0]), _strided(init[1]), torch.nn.Parameter(torch.randn(4, 6))]
    qs = [_strided(init[0]), _strided(init[1]), torch.nn.Parameter(ps[2].detach().clone())]
    ptrs = [p.data_ptr() for p in ps]
    assert not ps[0].is_contiguous() and ps[0].stride() == (10, 2)
    ours = offload_adam.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    ref = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False)

    def rewrite(t: int) -> None:
        if t == 9:  # a write into the model between steps (a load) is taken by the next step
            with torch.no_grad():
                ps[0].mul_(0.5)
                qs[0].mul_(0.5)

    run_twins(ours, ref, ps, qs, 30, after_step=rewrite)
    for p, q, ptr in zip(ps, qs, ptrs):
        assert p.data_ptr() == ptr and p.stride() == q.stride()
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert_state_close(ours, ref, ps, qs)
    # the state and its round trip follow the parameter's shape
    sd = ours.state_dict()
    assert sd["state"][0]["exp_avg"].shape == (10, 5)
    again = offload_adam.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    again.load_state_dict(sd)
    assert torch.equal(again.state[ps[0]]["exp_avg_sq"], ours.state[ps[0]]["exp_avg_sq"])


def test_forloop_goes_right_direction_with_strided_parameters() -> None:
    """torch's test_forloop_goes_right_direction(contiguous=False), for AdamW and Adam."""
    for cls in (offload_adam.AdamW, offload_adam.Adam):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn((10, 5, 2))[..., 0])
        bias = torch.nn.Parameter(torch.randn((10, 2))[..., 0])
        x = torch.randn(5)
        opt = cls([weight, bias], lr=1e-3)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (weight.mv(x) + bias).pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            opt.step(closure)
        assert closure().item() < initial


def test_an_overlapping_parameter_is_refused_clearly() -> None:
    p = torch.nn.Parameter(torch.randn(1, 4).expand(3, 4))
    with pytest.raises(ValueError, match="parameter 0 .*overlap in memory"):
        offload_adam.AdamW([p])
