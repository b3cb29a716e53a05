"""Bad input: a clear exception, raised before anything changes."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import clone_params, make_params

from offload_adam import Adam, AdamW


def snapshot(opt: torch.optim.Optimizer, ps: list[torch.Tensor]) -> Any:
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return [p.detach().clone() for p in ps], state, copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def assert_unchanged(opt: torch.optim.Optimizer, ps: list[torch.Tensor], snap: Any) -> None:
    weights, state, groups = snap
    for p, w in zip(ps, weights):
        assert torch.equal(p.detach(), w)
    assert set(state) == {id(p) for p in opt.state}
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def stepped(n: int = 3, **kw: Any) -> tuple[AdamW, list[torch.nn.Parameter]]:
    ps = make_params()
    opt = AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 1e-2}], **kw)
    for _ in range(n):
        for p in ps:
            p.grad = torch.randn(p.shape)
        opt.step()
    return opt, ps


def test_non_leaf_tensor() -> None:
    a = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        AdamW([a * 2])


def test_parameter_in_two_groups() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="more than one parameter group"):
        AdamW([{"params": [p]}, {"params": [p]}])
    opt = AdamW([p])
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


def test_empty_parameter_list() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        AdamW([])


def test_bad_group_hyperparameters_leave_the_optimizer_as_it_was() -> None:
    opt, ps = stepped()
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": -1.0})
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "betas": (0.9, 1.5)})
    assert len(opt.param_groups) == 2
    for p in ps:  # the optimizer still steps its two groups
        p.grad = torch.zeros(p.shape)
    opt.step()
    assert all(float(opt.state[p]["step"]) == 4 for p in ps)
    # a group edited to an invalid value after construction: refused at the step, nothing moved
    snap = snapshot(opt, ps)
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="param group 1: Invalid learning rate"):
        opt.step()
    opt.param_groups[1]["lr"] = 1e-2
    assert_unchanged(opt, ps, snap)


def test_unsupported_dtypes_and_layouts_are_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="dtype torch.float64 is not supported"):
        AdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    with pytest.raises(TypeError, match="dtype torch.complex128 is not supported"):
        AdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.complex128))])
    with pytest.raises(TypeError, match="layout"):
        AdamW([torch.nn.Parameter(torch.randn(3, 3).to_sparse())])
    base = torch.randn(10)
    with pytest.raises(ValueError, match="share memory"):
        AdamW([torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])])
    a = torch.nn.Parameter(base[:5])
    opt = AdamW([a])
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group({"params": [torch.nn.Parameter(base[3:8])]})
    assert len(opt.param_groups) == 1


def test_sparse_gradients() -> None:
    opt, ps = stepped()
    snap = snapshot(opt, ps)
    for p in ps:
        p.grad = torch.randn(p.shape)
    ps[4].grad = torch.zeros(ps[4].shape).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert_unchanged(opt, ps, snap)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt2 = Adam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt2.step()


def test_replaced_parameters_are_never_touched() -> None:
    model = torch.nn.Linear(4, 3)
    opt = AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    model.double()
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    w = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="storage was replaced.*float64"):
        opt.step()
    assert torch.equal(model.weight.detach(), w)

    # Replaced with the same shape and dtype: re-bound at the next step; the old storage is
    # never written again.
    p = torch.nn.Parameter(torch.randn(5))
    opt = AdamW([p])
    old = p.detach()
    p.data = torch.randn(5)
    old_values, new_values = old.clone(), p.detach().clone()
    p.grad = torch.ones(5)
    opt.step()
    assert torch.equal(old, old_values)
    assert not torch.equal(p.detach(), new_values) and float(opt.state[p]["step"]) == 1


def test_a_failed_step_changes_nothing() -> None:
    opt, ps = stepped()
    snap = snapshot(opt, ps)
    for p in ps:
        p.grad = torch.randn(p.shape)
    ps[-1].grad = torch.randn(33, 64).t()  # the last parameter of the last group: not contiguous
    with pytest.raises(ValueError, match="layout differs"):
        opt.step()
    assert_unchanged(opt, ps, snap)
    ps[-1].grad = torch.randn(ps[-1].shape)
    ps[2].grad.data = torch.randn(7)  # a gradient resized behind autograd's back
    with pytest.raises(ValueError, match="gradient has 7 elements"):
        opt.step()
    assert_unchanged(opt, ps, snap)
    ps[2].grad = torch.randn(ps[2].shape)
    ps[1].grad.data = ps[5].detach()[0, :1]  # a gradient that is another parameter's memory
    with pytest.raises(ValueError, match="shares memory"):
        opt.step()
    assert_unchanged(opt, ps, snap)


def test_nan_and_inf_gradients_propagate_as_in_torch() -> None:
    ps = make_params()
    qs = clone_params(ps)
    ours = AdamW(ps, lr=1e-3)
    ref = torch.optim.AdamW(qs, lr=1e-3, foreach=False)
    for p, q in zip(ps, qs):
        g = torch.randn(p.shape)
        if g.numel() > 3:
            g.view(-1)[0] = float("nan")
            g.view(-1)[1] = float("inf")
        p.grad, q.grad = g, g.clone()
    ours.step()
    ref.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p.isnan(), q.isnan())
        ok = ~q.isnan()
        torch.testing.assert_close(p[ok], q[ok], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])), "different number of parameter groups"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), "doesn't match the size"),
        (lambda sd: sd["state"][0].update(exp_avg=torch.zeros(2, 2)), "exp_avg has shape"),
        (lambda sd: sd["state"][1].pop("exp_avg_sq"), "missing key 'exp_avg_sq'"),
        (lambda sd: sd["state"][0].update(step=torch.tensor(-1.0)), "step must be a whole number"),
        (lambda sd: sd.pop("state"), "no 'state' key"),
        (lambda sd: sd["state"].update({99: sd["state"][0]}), "state for parameter 99"),
        (lambda sd: sd["param_groups"][1].update(lr=-1.0), "Invalid learning rate"),
        (lambda sd: sd["state"][0].update(exp_avg=torch.zeros(7, 13, dtype=torch.int64)), "dtype torch.int64"),
    ],
)
def test_bad_state_dicts_are_refused_and_change_nothing(mutate: Any, msg: str) -> None:
    opt, ps = stepped()
    sd = copy.deepcopy(opt.state_dict())
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step()
    snap = snapshot(opt, ps)
    mutate(sd)
    with pytest.raises((ValueError, TypeError), match=msg):
        opt.load_state_dict(sd)
    assert_unchanged(opt, ps, snap)


def test_amsgrad_checkpoint_needs_its_maximum() -> None:
    opt, ps = stepped(amsgrad=True)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]["max_exp_avg_sq"]
    with pytest.raises(ValueError, match="missing key 'max_exp_avg_sq'"):
        opt.load_state_dict(sd)


@pytest.mark.cuda
def test_cuda_parameters_are_offloaded_and_bad_ones_refused() -> None:
    p = torch.nn.Parameter(torch.randn(3, device="cuda"))
    opt = AdamW([p])
    assert opt.memory_report()["host_bytes"] > 0 and opt.memory_report()["gpu_bytes"] == 0
    with pytest.raises(ValueError, match="must be contiguous"):
        AdamW([torch.nn.Parameter(torch.randn(4, 3, device="cuda").t())])
    with pytest.raises(TypeError, match="cannot be offloaded"):
        AdamW([torch.nn.Parameter(torch.randn(3, device="cuda", dtype=torch.complex64))])
    p.grad = torch.ones(3, device="cuda")
    opt.step()
    p.data = p.data.double()
    p.grad = torch.ones(3, device="cuda", dtype=torch.float64)
    w = p.detach().clone()
    with pytest.raises(RuntimeError, match="moved or changed"):
        opt.step()
    assert torch.equal(p.detach(), w)


class _Wrapper(torch.Tensor):
    """A wrapper tensor subclass: no memory of its own behind its data pointer."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda t: t.elem if isinstance(t, _Wrapper) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def test_tensor_subclasses_without_memory_of_their_own_are_refused_at_construction(tmp_path: Any) -> None:
    """A wrapper subclass has no memory of its own: refused with a message naming it, before
    anything could read through its pointer. A DTensor is stepped through its local shard; a
    DTensor parameter given a plain-tensor gradient is refused at the step, nothing changed."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    with pytest.raises(TypeError, match="_Wrapper is not supported.*DTensors"):
        AdamW([_Wrapper(torch.randn(3))])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 3), mesh, [Replicate()]))
        opt = AdamW([p])
        p.grad = torch.ones(4, 3)  # a plain tensor: not the DTensor's
        before = p.detach().to_local().clone()
        with pytest.raises(TypeError, match="gradient of a DTensor parameter must be a DTensor"):
            opt.step()
        with pytest.raises(TypeError, match="gradient of a DTensor parameter must be a DTensor"):
            opt.clip_grad_norm_(1.0)
        assert torch.equal(p.detach().to_local(), before) and not opt.state
        p.grad = DTensor.from_local(torch.ones(4, 3), mesh, [Replicate()])
        opt.step()
        assert float(opt.state[p]["step"]) == 1 and isinstance(opt.state[p]["exp_avg"], DTensor)
        # A parameter subclass with memory of its own (FSDP1's FlatParameter, say) is accepted.
        class Mine(torch.nn.Parameter):
            pass

        q = Mine(torch.randn(3))
        q.grad = torch.ones(3)
        opt = AdamW([q])
        opt.step()
        assert float(opt.state[q]["step"]) == 1
    finally:
        dist.destroy_process_group()


# -- bounds and the unclear errors of RELIABILITY.md section 10 (issue 36, point 6) -------------


class _Layers(torch.nn.Module):
    """A small model of ``n`` repeated layers: each a block of offload_weights."""

    def __init__(self, n: int = 6, d: int = 32) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.fixture
def nvme_dir(tmp_path: Any) -> Iterator[str]:
    d = tmp_path / "nvme"
    d.mkdir()
    yield str(d)
    assert os.listdir(d) == []  # every run directory removed


def _model_snapshot(model: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    return {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}


def _assert_model_unchanged(model: torch.nn.Module, before: dict[str, tuple[int, torch.Tensor]]) -> None:
    assert not hasattr(model, "_offload_adam_weights")
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n


INF = float("inf")


@pytest.mark.parametrize("kw, exc, match", [
    ({"gpu_budget_gb": INF}, ValueError, r"gpu_budget_gb must be a finite number of GiB, at most 1048576 \(1 PiB\), got inf"),
    ({"gpu_budget_gb": 1e300}, ValueError, r"gpu_budget_gb must be a finite number of GiB.*got 1e\+300"),
    ({"gpu_budget_gb": "1"}, TypeError, r"gpu_budget_gb must be a number >= 0 \(of GiB\) or None, got '1' \(str\)"),
    ({"storage": "nvme", "host_budget_gb": INF}, ValueError, r"host_budget_gb must be a finite number of GiB.*got inf"),
    ({"storage": "nvme", "host_budget_gb": 1e300}, ValueError, r"host_budget_gb must be a finite number of GiB.*got 1e\+300"),
    ({"storage": "nvme", "host_budget_gb": True}, TypeError, r"host_budget_gb must be a number >= 0 \(of GiB\) or None, got True"),
    ({"storage": "nvme", "nvme_dir": 7}, TypeError, r"nvme_dir must be a path \(str, bytes or os.PathLike\).*got 7 \(int\)"),
    ({"storage": "nvme", "nvme_dir": b"/nonexistent-offload-adam"}, ValueError, r"nvme_dir: '/nonexistent-offload-adam' is not a directory"),
    ({"num_threads": "many"}, ValueError, r"num_threads must be an int >= 1 or None, got 'many'"),
])  # fmt: skip
def test_offload_weights_refuses_unbounded_and_mistyped_arguments_by_name(
    kw: dict[str, Any], exc: type, match: str, nvme_dir: str
) -> None:  # fmt: skip
    """``inf`` and ``1e300`` GiB used to be an OverflowError that named nothing (float infinity to
    integer); a budget is refused naming it, before the model changes."""
    from offload_adam import offload_weights, testing

    model = _Layers()
    before = _model_snapshot(model)
    if kw.get("storage") == "nvme":
        kw = {"nvme_dir": nvme_dir, **kw}
    with testing.simulated_device(max_delay_s=0.0), pytest.raises(exc, match=match):
        offload_weights(model, **kw)
    with pytest.raises(exc, match=match):
        offload_weights(model, device="cpu", **kw)
    _assert_model_unchanged(model, before)


# -- arguments a configuration ignores (issue 37, point 5) ------------------------------------


def test_a_gpu_budget_with_the_cpu_as_the_device_is_refused_naming_it(nvme_dir: str) -> None:
    """device="cpu" runs every block on the CPU: a GPU budget there would be ignored, and the
    caller expected an effect (it was accepted, and the budget dropped): refused, naming it,
    before the model changes, for both storages."""
    from offload_adam import offload_weights

    model = _Layers()
    before = _model_snapshot(model)
    for kw in ({}, {"storage": "nvme", "nvme_dir": nvme_dir}):
        with pytest.raises(ValueError, match=r"gpu_budget_gb=1\.0 would be ignored: the model runs on the CPU"):
            offload_weights(model, device="cpu", gpu_budget_gb=1, **kw)
    _assert_model_unchanged(model, before)


@pytest.mark.parametrize("kw, on_device, match", [
    ({"device": "cpu", "placement": "auto"}, False, r"placement='auto' is ignored: the model runs on the CPU"),
    ({"device": "cpu", "prefetch": 5}, False, r"prefetch=5 is ignored: device='cpu' with storage='cpu' keeps every block in RAM"),
    ({"placement": "stream", "native_matmul": True}, True, r"native_matmul=True is ignored: with placement='stream' on a GPU"),
    ({"placement": "cpu", "cost_model": "model"}, True, r"cost_model=.* is ignored: only placement='auto' on a GPU"),
])  # fmt: skip
def test_harmless_ignored_arguments_are_warned_of_naming_them(kw: dict[str, Any], on_device: bool, match: str) -> None:
    """What changes nothing where it is given is accepted with a warning that names it; the
    offload then works as without it."""
    from offload_adam import offload_weights, testing
    from offload_adam.runtime import costs

    if kw.get("cost_model") == "model":
        kw = {**kw, "cost_model": costs.CostModel()}
    model = _Layers()
    x = torch.randn(2, 32)
    want = model(x)
    with contextlib.ExitStack() as stack:
        if on_device:
            stack.enter_context(testing.simulated_device(max_delay_s=0.0))
        with pytest.warns(UserWarning, match=match):
            h = offload_weights(model, **kw)
        try:
            got = model(x.to(h.device.torch_device) if on_device else x).cpu()
        finally:
            h.close()
    assert torch.equal(got, want)


@pytest.mark.parametrize("kw", [
    {"device": "cpu"}, {"device": "cpu", "placement": "cpu", "prefetch": 2}, {"device": "cpu", "native_matmul": False},
    {"placement": "auto", "native_matmul": True}, {"placement": "stream", "native_matmul": False}, {"gpu_budget_gb": 1},
])  # fmt: skip
def test_arguments_that_apply_are_taken_without_a_word(kw: dict[str, Any]) -> None:
    """The rules name only what a configuration ignores: an argument at its default, or one
    that has an effect there, gives no warning."""
    import warnings

    from offload_adam import offload_weights, testing

    model = _Layers()
    with contextlib.ExitStack() as stack:
        if kw.get("device") != "cpu":
            stack.enter_context(testing.simulated_device(max_delay_s=0.0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            offload_weights(model, **kw).close()


@pytest.mark.parametrize("kw, exc, match", [
    ({"host_budget_gb": INF, "storage": "nvme"}, ValueError, r"host_budget_gb must be a finite number of GiB.*got inf"),
    ({"host_budget_gb": 1e300, "storage": "nvme"}, ValueError, r"host_budget_gb must be a finite number of GiB.*got 1e\+300"),
    ({"host_budget_gb": "1"}, TypeError, r"host_budget_gb must be a number >= 0 \(of GiB\), got '1' \(str\)"),
    ({"bucket_mb": INF}, ValueError, r"bucket_mb must be a finite number of MiB.*got inf"),
    ({"bucket_mb": 1e300}, ValueError, r"bucket_mb must be a finite number of MiB.*got 1e\+300"),
    ({"bucket_mb": "32"}, TypeError, r"bucket_mb must be a number > 0 \(of MiB\), got '32' \(str\)"),
    ({"bucket_mb": None}, TypeError, r"bucket_mb must be a number > 0 \(of MiB\), got None \(NoneType\)"),
    ({"bucket_mb": float("nan")}, ValueError, r"bucket_mb must be a number > 0 \(of MiB\), got nan"),
    ({"bucket_mb": 0}, ValueError, r"bucket_mb must be a number > 0 \(of MiB\), got 0"),
    ({"storage": "nvme", "nvme_dir": 7}, TypeError, r"nvme_dir must be a path \(str, bytes or os.PathLike\).*got 7 \(int\)"),
    ({"storage": "nvme", "nvme_dir": b"/nonexistent-offload-adam"}, ValueError, r"nvme_dir: '/nonexistent-offload-adam' is not a directory"),
])  # fmt: skip
def test_adamw_refuses_unbounded_and_mistyped_arguments_by_name(kw: dict[str, Any], exc: type, match: str, nvme_dir: str) -> None:
    opt, ps = stepped()
    snap = snapshot(opt, ps)
    if kw.get("storage") == "nvme" and "nvme_dir" not in kw:
        kw = {"nvme_dir": nvme_dir, **kw}
    with pytest.raises(exc, match=match):
        AdamW(ps, **kw)
    assert_unchanged(opt, ps, snap)
    for p in ps:  # the first optimizer still steps
        p.grad = torch.zeros(p.shape)
    opt.step()


def test_adamw_nvme_dir_7_is_refused_even_where_a_folder_7_exists(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``str(7)`` was taken: with a folder ``./7`` the state went there. It is refused as
    offload_weights refuses it, and nothing is written."""
    (tmp_path / "7").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=r"nvme_dir must be a path"):
        AdamW(make_params(), storage="nvme", nvme_dir=7)
    assert os.listdir(tmp_path / "7") == []


def test_bytes_nvme_dirs_are_paths(nvme_dir: str) -> None:
    """``nvme_dir=b"/existing/dir"`` was refused as "not a directory", which was false: a bytes
    path is taken as the OS gives it (``os.fsdecode``), by all three offloads."""
    from offload_adam import offload_activations, offload_weights, testing

    raw = os.fsencode(nvme_dir)
    ps = make_params()
    opt = AdamW(ps, storage="nvme", nvme_dir=raw)
    for p in ps:
        p.grad = torch.ones(p.shape)
    opt.step()
    assert len(os.listdir(nvme_dir)) == 1  # its run directory, under the decoded path
    opt.close()
    model = _Layers(n=3)
    x = torch.randn(2, 32)
    with torch.no_grad():
        want = model(x)
        h = offload_weights(model, device="cpu", storage="nvme", nvme_dir=raw)
        assert torch.equal(model(x), want)
        h.close()
    with testing.simulated_device(max_delay_s=0.0):
        offload_activations(storage="nvme", nvme_dir=raw).close()


def _affinity(monkeypatch: pytest.MonkeyPatch, cpus: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))


def test_num_threads_above_the_cpus_this_process_may_use_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AdamW(num_threads=2048)`` started 2048 threads, and offload_weights(num_threads=4096)
    about 11,500, on two CPUs: above the affinity set it is refused, naming num_threads and the
    count; the default is torch's thread count, capped at that set."""
    from offload_adam import offload_weights

    _affinity(monkeypatch, 2)
    ps = make_params()
    with pytest.raises(ValueError, match=r"num_threads=3 is more than the 2 CPUs this process may use \(os.sched_getaffinity\): at most 2"):
        AdamW(ps, num_threads=3)
    with pytest.raises(ValueError, match=r"num_threads=2048 is more than the 2 CPUs"):
        AdamW(ps, num_threads=2048)
    assert not any(p.grad is not None for p in ps)
    model = _Layers(n=3)
    before = _model_snapshot(model)
    with pytest.raises(ValueError, match=r"num_threads=4096 is more than the 2 CPUs this process may use"):
        offload_weights(model, device="cpu", num_threads=4096)
    _assert_model_unchanged(model, before)
    assert AdamW(ps, num_threads=2)._config["num_threads"] == 2  # at the bound: taken
    # the default: torch's, within the affinity set
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert AdamW(ps)._config["num_threads"] == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert AdamW(ps)._config["num_threads"] == 2


def test_prefetch_far_above_the_streamed_blocks_warns_and_is_capped(nvme_dir: str) -> None:
    """``prefetch=10**9`` with storage="nvme" on the CPU allocated RAM ring slots until memory ran
    out (RELIABILITY.md defect 7): it warns and the ring holds at most the streamed blocks."""
    from offload_adam import offload_weights

    model = _Layers(n=6)
    x = torch.randn(2, 32)
    with torch.no_grad():
        want = model(x)
    with pytest.warns(UserWarning, match=r"prefetch=1000000000 is more than the 6 streamed blocks; capped at 6"):
        h = offload_weights(model, device="cpu", storage="nvme", nvme_dir=nvme_dir, prefetch=10**9, native_matmul=False)
    rep = h.report()
    page = max(b.nbytes for b in h.blocks)
    assert rep["streamed_blocks"] == 6 and h.prefetch == 6
    assert 0 < rep["host_ring_bytes"] <= 6 * (page + 4096)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    h.close()
