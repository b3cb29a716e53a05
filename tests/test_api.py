"""The optimizer's public surface against torch's: signature, groups, schedulers, checkpoints."""

from __future__ import annotations

import copy
import inspect
import os
import signal
from typing import Any

import pytest
import torch
from helpers import SHAPES, assert_state_close, clone_params, deep, make_params, max_diff, run_twins

import offload_adam
from offload_adam import Adam, AdamW

EXTRAS = {
    "num_threads", "state_dtype", "master_dtype", "storage", "offload", "bias_correction", "free_gradients", "async_step", "bucket_mb",
    "nvme_dir", "host_budget_gb", "nvme_read_ahead",
}  # fmt: skip


@pytest.mark.parametrize("ours,ref", [(AdamW, torch.optim.AdamW), (Adam, torch.optim.Adam)])
def test_signature_and_defaults_match_torch(ours: type, ref: type) -> None:
    a = inspect.signature(ours.__init__).parameters
    b = inspect.signature(ref.__init__).parameters
    for name, param in b.items():
        assert name in a, name
        assert a[name].default == param.default, name
        assert a[name].kind == param.kind, name
    assert set(a) - set(b) == EXTRAS
    assert all(a[k].kind == inspect.Parameter.KEYWORD_ONLY for k in EXTRAS)
    ps = make_params()
    o, r = ours(ps), ref(clone_params(ps))
    assert isinstance(o, torch.optim.Optimizer)
    assert o.defaults == r.defaults
    assert list(o.param_groups[0]) == list(r.param_groups[0])


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"lr": float("nan")}, "Invalid learning rate"),
        ({"eps": -1e-8}, "Invalid epsilon value"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1"),
        ({"betas": (0.9, float("nan"))}, "Invalid beta parameter at index 1"),
        ({"weight_decay": -0.1}, "Invalid weight_decay value"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, "Tensor lr must be 1-element"),
        ({"capturable": True}, "capturable=True is not supported"),
        ({"differentiable": True}, "differentiable=True is not supported"),
        ({"state_dtype": torch.float16}, "state_dtype must be"),
        ({"master_dtype": torch.float16}, "master_dtype must be"),
        ({"offload": "disk"}, "offload must be one of"),
        ({"offload": "nvme"}, "offload=\"nvme\" needs nvme_dir"),
        ({"offload": "cpu", "nvme_dir": "/tmp"}, "nvme_dir is only used with offload=\"nvme\""),
        ({"host_budget_gb": -1}, "host_budget_gb must be"),
        ({"offload": "cpu", "host_budget_gb": 8}, 'host_budget_gb is only used with offload="nvme"'),
        ({"host_budget_gb": 8}, 'host_budget_gb is only used with storage="nvme"'),
        ({"nvme_read_ahead": -1}, "nvme_read_ahead must be"),
        ({"storage": "disk"}, "storage must be one of"),
        ({"storage": "nvme"}, "storage=\"nvme\" needs nvme_dir"),
        ({"nvme_dir": "/tmp"}, "nvme_dir is only used with storage=\"nvme\""),
        ({"storage": "cpu", "offload": "nvme"}, "storage and offload name the same choice"),
        ({"num_threads": 0}, "num_threads must be an int >= 1"),
    ],
)
def test_invalid_arguments_raise_like_torch(kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        AdamW(make_params(), **kw)


def test_storage_is_the_word_for_where_the_state_lives_and_offload_its_alias(tmp_path: Any) -> None:
    """``storage=`` as offload_weights and offload_activations say it; ``offload=`` still works,
    alone or given the same value."""
    for kw in ({}, {"storage": "cpu"}, {"offload": "cpu"}, {"storage": "cpu", "offload": "cpu"}):
        opt = AdamW(make_params(), **kw)
        assert opt.storage == opt.offload == "cpu"
    for kw in ({"storage": "nvme"}, {"offload": "nvme"}, {"storage": "nvme", "offload": "nvme"}):
        opt = AdamW(make_params(), nvme_dir=str(tmp_path), **kw)
        assert opt.storage == "nvme" and opt.memory_report()["nvme_bytes"] > 0
        twin = copy.deepcopy(opt)
        assert twin.storage == "nvme"
        twin.close()
        opt.close()


@pytest.mark.parametrize("kw", [{"free_gradients": True}, {"async_step": True}])
def test_gpu_only_options_on_cpu_parameters_warn_that_they_change_nothing(kw: dict[str, Any]) -> None:
    """These used to pass silently: on CPU parameters the step reads .grad in place, in step()."""
    with pytest.warns(UserWarning, match="every parameter here is on the CPU.*change nothing"):
        AdamW(make_params(), **kw)


def test_a_failed_pin_names_its_likely_causes() -> None:
    from offload_adam.runtime.device import pin_error

    msg = str(pin_error(3 << 30, 2))
    assert "3221225472 bytes (3 GiB)" in msg and "ulimit -l" in msg and "offload='nvme'" in msg and "CUDA error 2" in msg


def test_harmless_torch_flags_are_accepted() -> None:
    for kw in ({"foreach": True}, {"foreach": False}, {"fused": True}, {"fused": False}):
        ps = make_params()
        qs = clone_params(ps)
        ours = AdamW(ps, lr=1e-3, **kw)
        ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
        run_twins(ours, ref, ps, qs, 5)
        assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5


def test_tensor_lr_and_add_param_group() -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps[:3], lr=torch.tensor(2e-3))
    ref = torch.optim.AdamW(qs[:3], lr=torch.tensor(2e-3), foreach=False)
    ours.add_param_group({"params": ps[3:], "lr": 5e-3, "amsgrad": True})
    ref.add_param_group({"params": qs[3:], "lr": 5e-3, "amsgrad": True})
    run_twins(ours, ref, ps, qs, 30)
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    assert_state_close(ours, ref, ps, qs)


def test_amsgrad_switched_on_later_like_a_fresh_group() -> None:
    p = torch.nn.Parameter(torch.randn(10))
    opt = AdamW([p], lr=1e-3)
    p.grad = torch.randn(10)
    opt.step()
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.randn(10)
    opt.step()
    assert "max_exp_avg_sq" in opt.state[p]
    assert torch.all(opt.state[p]["max_exp_avg_sq"] >= opt.state[p]["exp_avg_sq"])


def test_named_parameters_appear_in_errors() -> None:
    model = torch.nn.Linear(3, 2)
    opt = AdamW(model.named_parameters())
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    model.weight.grad = torch.ones(3, 2).t()  # non-contiguous
    with pytest.raises(ValueError, match="'weight'.*layout differs"):
        opt.step()


def _schedulers(opt: torch.optim.Optimizer) -> list[Any]:
    S = torch.optim.lr_scheduler
    return [
        S.StepLR(opt, step_size=5, gamma=0.5),
        S.MultiStepLR(opt, milestones=[3, 9], gamma=0.3),
        S.ConstantLR(opt, factor=0.5, total_iters=4),
        S.LinearLR(opt, start_factor=0.2, total_iters=6),
        S.ExponentialLR(opt, gamma=0.95),
        S.PolynomialLR(opt, total_iters=10, power=2.0),
        S.CosineAnnealingLR(opt, T_max=10),
        S.CosineAnnealingWarmRestarts(opt, T_0=4),
        S.LambdaLR(opt, lambda t: 1 / (t + 1)),
        S.MultiplicativeLR(opt, lambda t: 0.9),
        S.CyclicLR(opt, base_lr=1e-4, max_lr=1e-2, step_size_up=3, cycle_momentum=True),
        S.OneCycleLR(opt, max_lr=1e-2, total_steps=40),
    ]


@pytest.mark.parametrize("k", range(12))
def test_every_lr_scheduler(k: int) -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
    s1, s2 = _schedulers(ours)[k], _schedulers(ref)[k]
    seen_betas = set()

    def after(_: int) -> None:
        s1.step()
        s2.step()
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
        assert ours.param_groups[0]["betas"] == ref.param_groups[0]["betas"]
        seen_betas.add(ours.param_groups[0]["betas"])

    run_twins(ours, ref, ps, qs, 30, after_step=after)
    assert "initial_lr" in ours.param_groups[0]
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    if type(s1).__name__ in ("OneCycleLR", "CyclicLR"):
        assert len(seen_betas) > 5  # betas[0] cycles and the kernel follows it


def test_reduce_lr_on_plateau_and_sequential_schedulers() -> None:
    S = torch.optim.lr_scheduler
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-2)
    ref = torch.optim.AdamW(qs, lr=1e-2, foreach=False)
    pl1, pl2 = S.ReduceLROnPlateau(ours, patience=1), S.ReduceLROnPlateau(ref, patience=1)
    sq1 = S.SequentialLR(ours, [S.ConstantLR(ours, 0.5, 3), S.ExponentialLR(ours, 0.9)], milestones=[3])
    sq2 = S.SequentialLR(ref, [S.ConstantLR(ref, 0.5, 3), S.ExponentialLR(ref, 0.9)], milestones=[3])

    def after(t: int) -> None:
        pl1.step(1.0)  # a plateau: the lr drops
        pl2.step(1.0)
        sq1.step()
        sq2.step()

    run_twins(ours, ref, ps, qs, 20, after_step=after)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < 1e-3
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5


def test_closure_and_zero_grad() -> None:
    model = torch.nn.Linear(4, 1)
    opt = AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    calls = []

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        calls.append(float(loss.detach()))
        return loss

    with torch.no_grad():
        losses = [float(opt.step(closure).detach()) for _ in range(20)]
    assert losses == calls and losses[-1] < losses[0]
    assert opt.step() is None
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    closure()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in model.parameters())


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_moves_between_torch_and_us(amsgrad: bool) -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3, amsgrad=amsgrad)
    ref = torch.optim.AdamW(qs, lr=1e-3, amsgrad=amsgrad, foreach=False)
    run_twins(ours, ref, ps, qs, 20)
    sd = ours.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert sd["param_groups"][0]["params"] == list(range(len(ps)))
    # ours -> torch, torch -> ours, then both continue on the same trajectory
    ps2, qs2 = clone_params(ps), clone_params(qs)
    torch_from_ours = torch.optim.AdamW(qs2, lr=1e-3, amsgrad=amsgrad, foreach=False)
    torch_from_ours.load_state_dict(deep(ours.state_dict()))
    ours_from_torch = AdamW(ps2, lr=1e-3, amsgrad=amsgrad)
    ours_from_torch.load_state_dict(deep(ref.state_dict()))
    assert ours_from_torch.state[ps2[0]]["exp_avg"].device.type == "cpu"
    torch.manual_seed(7)
    run_twins(ours_from_torch, torch_from_ours, ps2, qs2, 30)
    torch.manual_seed(7)
    run_twins(ours, ref, ps, qs, 30)
    for a, b, c in zip(ps2, qs2, qs):
        assert max_diff(a, b) <= 2e-5
        assert max_diff(a, c) <= 2e-5
    assert_state_close(ours_from_torch, torch_from_ours, ps2, qs2)


def test_state_dict_survives_save_and_load(tmp_path: Any) -> None:
    ps = make_params(dtype=torch.bfloat16)
    ours = AdamW(ps, lr=1e-3, state_dtype=torch.bfloat16)
    for _ in range(5):
        for p in ps:
            p.grad = torch.randn(p.shape).bfloat16()
        ours.step()
    torch.save({"opt": ours.state_dict(), "model": [p.detach() for p in ps]}, tmp_path / "ckpt.pt")
    ck = torch.load(tmp_path / "ckpt.pt")
    assert "master_param" in ck["opt"]["state"][0]
    ps2 = [torch.nn.Parameter(t.clone()) for t in ck["model"]]
    resumed = AdamW(ps2, lr=1e-3, state_dtype=torch.bfloat16)
    resumed.load_state_dict(ck["opt"])
    st = resumed.state[ps2[0]]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["master_param"].dtype == torch.float32
    torch.manual_seed(3)
    grads = [torch.randn(p.shape).bfloat16() for p in ps]
    for p, p2, g in zip(ps, ps2, grads):
        p.grad, p2.grad = g, g.clone()
    ours.step()
    resumed.step()
    for p, p2 in zip(ps, ps2):
        assert torch.equal(p, p2)
        if p.numel():
            assert torch.equal(ours.state[p]["master_param"], resumed.state[p2]["master_param"])


def test_torch_state_for_low_precision_params_loads_into_fp32_state() -> None:
    ps = make_params(dtype=torch.bfloat16)
    ref = torch.optim.AdamW(clone_params(ps), lr=1e-3)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape).bfloat16()
    ref.step()
    ours = AdamW(ps, lr=1e-3)
    ours.load_state_dict(deep(ref.state_dict()))
    st = ours.state[ps[0]]
    assert st["exp_avg"].dtype == torch.float32  # our dtype, not the param's
    assert torch.equal(st["master_param"], ps[0].float())


def test_fork_safety() -> None:
    """A forked child (a DataLoader worker) gets a working pool of its own."""
    ps = [torch.nn.Parameter(torch.randn(200_000))]
    opt = AdamW(ps, num_threads=2)
    ps[0].grad = torch.randn(200_000)
    opt.step()
    pid = os.fork()
    if pid == 0:  # child
        try:
            signal.alarm(60)
            opt.step()
            os._exit(0 if float(opt.state[ps[0]]["step"]) == 2 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    opt.step()
    assert float(opt.state[ps[0]]["step"]) == 2


def test_exports() -> None:
    assert offload_adam.simd_path() in offload_adam.simd_paths()
    assert offload_adam.__version__
    assert len(SHAPES) > 3


def test_grad_scaler_and_clip_fast_path_on_cpu_parameters() -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
    sa = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for t in range(12):
        sa.scale(torch.ones(()))  # a real loop scales its loss; this initializes the scale
        sb.scale(torch.ones(()))
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape) * sa.get_scale()
            if t == 5 and g.numel():
                g.view(-1)[0] = float("inf")
            p.grad, q.grad = g, g.clone()
        sa.step(ours)
        sa.update()
        sb.step(ref)
        sb.update()
    assert sa.get_scale() == sb.get_scale()
    assert float(ours.state[ps[0]]["step"]) == 11
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    # the clip fast path: torch's norm, coefficient folded into the next step
    for p, q in zip(ps, qs):
        g = torch.randn(p.shape) * 10
        p.grad, q.grad = g, g.clone()
    norm = ours.clip_grad_norm_(1.0)
    want = torch.nn.utils.clip_grad_norm_(qs, 1.0)
    assert abs(float(norm) - float(want)) <= 1e-5 * float(want)
    ours.step()
    ref.step()
    assert max(max_diff(p, q) for p, q in zip(ps, qs)) <= 2e-5
    with pytest.raises(ValueError, match="norm_type"):
        ours.clip_grad_norm_(1.0, norm_type=1.0)
