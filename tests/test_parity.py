"""Exactness: every mode agrees with torch.optim.AdamW/Adam(foreach=False) run in fp32 over 200
steps of random gradients (max |w - w_torch| <= 2e-5 at lr 1e-3, moments within rtol 1e-4)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from helpers import assert_state_close, clone_params, groups_like, make_params, max_diff, run_twins

import offload_adam
from offload_adam import Adam, AdamW

STEPS = 200
WEIGHT_TOL = 2e-5

MODES: list[tuple[str, type, type, dict[str, Any]]] = [
    ("adamw", AdamW, torch.optim.AdamW, {}),
    ("adamw-wd0", AdamW, torch.optim.AdamW, {"weight_decay": 0.0}),
    ("adamw-wd", AdamW, torch.optim.AdamW, {"weight_decay": 0.1}),
    ("adam", Adam, torch.optim.Adam, {}),
    ("adam-l2", Adam, torch.optim.Adam, {"weight_decay": 0.05}),
    ("adamw-amsgrad", AdamW, torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
    ("adam-amsgrad-l2", Adam, torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.05}),
    ("adamw-maximize", AdamW, torch.optim.AdamW, {"maximize": True}),
    ("adam-maximize-amsgrad-l2", Adam, torch.optim.Adam, {"maximize": True, "amsgrad": True, "weight_decay": 0.01}),
    ("adamw-betas-eps", AdamW, torch.optim.AdamW, {"betas": (0.8, 0.99), "eps": 1e-6}),
]


@pytest.mark.parametrize("name,ours_cls,ref_cls,kw", MODES, ids=[m[0] for m in MODES])
def test_matches_torch_over_200_steps(name: str, ours_cls: type, ref_cls: type, kw: dict[str, Any]) -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = ours_cls(ps, lr=1e-3, **kw)
    ref = ref_cls(qs, lr=1e-3, foreach=False, **kw)
    run_twins(ours, ref, ps, qs, STEPS)
    for p, q in zip(ps, qs):
        assert max_diff(p, q) <= WEIGHT_TOL
    assert_state_close(ours, ref, ps, qs)


def test_tiny_gradients_where_eps_matters() -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3, eps=1e-8)
    ref = torch.optim.AdamW(qs, lr=1e-3, eps=1e-8, foreach=False)
    run_twins(ours, ref, ps, qs, STEPS, grad_scale=1e-9)
    for p, q in zip(ps, qs):
        assert max_diff(p, q) <= WEIGHT_TOL
    assert_state_close(ours, ref, ps, qs)


def test_groups_with_different_hyperparameters_and_a_scheduler() -> None:
    ps = make_params()
    qs = clone_params(ps)
    spec = [
        {"params": ps[:2], "lr": 2e-3, "betas": (0.85, 0.995), "weight_decay": 0.0},
        {"params": ps[2:4], "amsgrad": True, "eps": 1e-7},
        {"params": ps[4:], "weight_decay": 0.2, "maximize": True},
    ]
    ours = AdamW(spec, lr=1e-3)
    ref = torch.optim.AdamW(groups_like(spec, qs), lr=1e-3, foreach=False)
    s1 = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=STEPS)
    s2 = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=STEPS)

    def sched(_: int) -> None:
        s1.step()
        s2.step()

    run_twins(ours, ref, ps, qs, STEPS, after_step=sched)
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups]
    for p, q in zip(ps, qs):
        assert max_diff(p, q) <= WEIGHT_TOL
    assert_state_close(ours, ref, ps, qs)


def test_params_without_grad_are_skipped_and_keep_their_step() -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
    # param 0 gets a gradient every other step, param 1 only from step 50 on.
    run_twins(ours, ref, ps, qs, 100, skip=lambda t, i: (i == 0 and t % 2 == 1) or (i == 1 and t < 50))
    assert float(ours.state[ps[0]]["step"]) == 50
    assert float(ours.state[ps[1]]["step"]) == 50
    assert float(ours.state[ps[2]]["step"]) == 100
    for p, q in zip(ps, qs):
        assert max_diff(p, q) <= WEIGHT_TOL
    assert_state_close(ours, ref, ps, qs)


def test_state_is_created_lazily() -> None:
    ps = make_params()
    opt = AdamW(ps)
    assert len(opt.state) == 0
    ps[1].grad = torch.ones_like(ps[1])
    opt.step()
    assert list(opt.state) == [ps[1]]
    assert set(opt.state[ps[1]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[ps[1]]["step"].dtype == torch.float32 and opt.state[ps[1]]["step"].dim() == 0


def test_complex_parameters_like_torch() -> None:
    ps = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.complex64)), torch.nn.Parameter(torch.randn(4))]
    qs = clone_params(ps)
    ours = Adam(ps, lr=1e-3, weight_decay=0.01, amsgrad=True)
    ref = torch.optim.Adam(qs, lr=1e-3, weight_decay=0.01, amsgrad=True, foreach=False)
    run_twins(ours, ref, ps, qs, 50)
    for p, q in zip(ps, qs):
        assert max_diff(torch.view_as_real(p) if p.is_complex() else p, torch.view_as_real(q) if q.is_complex() else q) <= WEIGHT_TOL
    assert ours.state[ps[0]]["exp_avg"].dtype == torch.complex64


def test_tied_parameters() -> None:
    torch.manual_seed(1)

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.mid = torch.nn.Linear(6, 6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.mid(self.emb(x))))

    a = Tied()
    b = Tied()
    b.load_state_dict(a.state_dict())
    ours = AdamW(a.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    for _ in range(50):
        x = torch.randint(0, 11, (8,))
        for m, o in ((a, ours), (b, ref)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), x).backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert max_diff(p, q) <= WEIGHT_TOL
    # a parameter listed twice is stepped once (torch warns about it, and would step it twice)
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = AdamW([p, p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert float(opt.state[p]["step"]) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_masters(dtype: torch.dtype) -> None:
    ps = make_params(dtype=dtype)
    qs = clone_params(ps, torch.float32)  # torch in fp32 from the same (rounded) start
    ours = AdamW(ps, lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(qs, lr=1e-3, weight_decay=0.1, foreach=False)
    run_twins(ours, ref, ps, qs, STEPS)
    for p, q in zip(ps, qs):
        master = ours.state[p]["master_param"] if p.numel() else p.float()
        assert master.dtype == torch.float32
        # The master follows torch's fp32 trajectory fed with the same (rounded) gradients...
        assert max_diff(master, q) <= WEIGHT_TOL
        # ...and the model's weights are exactly the master rounded to their dtype.
        assert torch.equal(p.detach(), master.to(dtype))
    assert_state_close(ours, ref, ps, qs)


def test_model_edits_of_low_precision_weights_are_taken_over() -> None:
    p = torch.nn.Parameter(torch.randn(40).to(torch.bfloat16))
    opt = AdamW([p], lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.randn(40).to(torch.bfloat16)
        opt.step()
    with torch.no_grad():
        p.copy_(torch.full((40,), 2.0))  # e.g. model.load_state_dict()
    p.grad = torch.zeros(40, dtype=torch.bfloat16)
    opt.step()
    # step with zero grad moves the weights by at most lr (the moments are not zero)
    assert (opt.state[p]["master_param"] - 2.0).abs().max() < 1e-2
    assert (p.float() - 2.0).abs().max() < 2e-2


def test_bf16_state_tracks_fp32_closely() -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3, state_dtype=torch.bfloat16, amsgrad=True)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False, amsgrad=True)
    run_twins(ours, ref, ps, qs, 100)
    assert ours.state[ps[0]]["exp_avg"].dtype == torch.bfloat16
    for p, q in zip(ps, qs):
        # bf16 moments (8 mantissa bits) change each update by up to ~0.4%: after 100 steps of
        # lr 1e-3 the weights stay within a few percent of an lr of torch's.
        assert max_diff(p, q) <= 5e-3


def test_results_do_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three threads even on two CPUs (the bound AdamW keeps to os.sched_getaffinity): the
    # chunks, not the CPUs, decide the result.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
    shapes = [(300_001,), (65, 1025), (3,)]
    base = make_params(shapes)
    outs = []
    for threads in (1, 2, 3):
        ps = clone_params(base)
        opt = AdamW(ps, lr=1e-3, amsgrad=True, num_threads=threads)
        torch.manual_seed(5)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape)
            opt.step()
        outs.append([p.detach().clone() for p in ps])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


SCRIPT = r"""
import torch, sys
sys.path.insert(0, {tests!r})
from helpers import make_params, clone_params, run_twins, max_diff
import offload_adam
assert offload_adam.simd_path() == {path!r}, offload_adam.simd_path()
torch.manual_seed(0)
ps = make_params(); qs = clone_params(ps)
ours = offload_adam.AdamW(ps, lr=1e-3, weight_decay=0.1, amsgrad=True)
ref = torch.optim.AdamW(qs, lr=1e-3, weight_decay=0.1, amsgrad=True, foreach=False)
run_twins(ours, ref, ps, qs, 200)
print(max(max_diff(p, q) for p, q in zip(ps, qs)))
"""


@pytest.mark.parametrize("path", offload_adam.simd_paths())
def test_every_simd_path_matches_torch(path: str) -> None:
    env = {**os.environ, "OFFLOAD_ADAM_SIMD": path}
    code = SCRIPT.format(tests=os.path.dirname(__file__), path=path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) <= WEIGHT_TOL


def test_unknown_simd_path_is_a_clear_error() -> None:
    env = {**os.environ, "OFFLOAD_ADAM_SIMD": "sse9"}
    code = "import torch, offload_adam; offload_adam.AdamW([torch.nn.Parameter(torch.zeros(2))])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "OFFLOAD_ADAM_SIMD" in out.stderr and "sse9" in out.stderr
