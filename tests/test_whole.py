"""The model whole after any failed offload (issue 36, point 3): ``offload_weights`` either
completes or leaves every parameter exactly as it was, bitwise (the same objects under the same
names, their type, dtype, device, ``requires_grad`` and bytes; ties; buffers; the modules'
attributes), with the error; no failure loses a weight, and nothing is left in ``nvme_dir``.
The failures: a write error storing a block (RELIABILITY.md defect 2), a failure after every
block is stored."""

from __future__ import annotations

import contextlib
import copy
import errno
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing
from offload_adam.runtime import pages

from test_weights import gpt2, llama, nvme_dir, prompt  # noqa: F401 (nvme_dir: a fixture)

NATIVE_OFF: dict[str, Any] = {"native_matmul": False}  # (bitwise against the model resident: see test_quantized)


def _tensors(p: torch.Tensor) -> list[torch.Tensor] | None:
    """``p``'s bytes (a quantized parameter's inner tensors), cloned; None on the meta device."""
    if p.device.type == "meta":
        return None
    if type(p) is torch.nn.Parameter:
        return [p.detach().clone()]
    names, _ = p.__tensor_flatten__()  # type: ignore[attr-defined]
    return [getattr(p, n).clone() for n in names]


def state(model: torch.nn.Module) -> dict[str, Any]:
    """What a failed offload must leave as it was."""
    return {
        "params": {
            n: (p, type(p), p.dtype, p.device, p.requires_grad, tuple(p.shape), _tensors(p))
            for n, p in model.named_parameters(remove_duplicate=False)
        },
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers(remove_duplicate=False)},
        "modules": {n: (m, sorted(vars(m))) for n, m in model.named_modules(remove_duplicate=False)},
        "repr": repr(model),
    }


def assert_as_before(model: torch.nn.Module, before: dict[str, Any]) -> None:
    now = state(model)
    assert now["params"].keys() == before["params"].keys()
    for n, (p, *meta, data) in before["params"].items():
        q, *meta_now, data_now = now["params"][n]
        assert q is p, f"{n}: another parameter object"  # (so ties hold: the same object under every name)
        assert meta_now == meta, (n, meta_now, meta)
        assert (data is None) == (data_now is None), n
        if data is not None:
            assert all(torch.equal(a, b) for a, b in zip(data_now, data, strict=True)), n
    assert now["buffers"].keys() == before["buffers"].keys()
    for n, (b, value) in before["buffers"].items():
        assert now["buffers"][n][0] is b and torch.equal(b, value), n
    assert {n: (m, a) for n, (m, a) in now["modules"].items()} == before["modules"]
    assert now["repr"] == before["repr"]
    assert not hasattr(model, "_offload_adam_weights")


@contextlib.contextmanager
def writes_failing(after: int = 2) -> Iterator[None]:
    """Every run directory made inside fails its write number ``after + 1`` with ENOSPC (a
    filesystem that over-commits, or a quota): RELIABILITY.md defect 2's repro."""
    orig = pages.RunDir.__init__

    def init(self: pages.RunDir, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        self.io.inject_fault("write", errno.ENOSPC, after)

    pages.RunDir.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        pages.RunDir.__init__ = orig  # type: ignore[method-assign]


@torch.no_grad()
def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


# -- storing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["device-cpu", "simulated"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_write_error_storing_a_block_leaves_every_weight_as_it_was(arch: str, where: str, nvme_dir: str) -> None:
    """Defect 2: the third block's page fails to write (ENOSPC). The blocks stored before it used
    to point at placeholders while the file was deleted: the embedding and layer 0 read NaN.
    Now: the error, every parameter as it was (GPT-2's tied head still tied), nothing left in
    nvme_dir, and the next offload works and is exact."""
    model = {"llama": llama, "gpt2": gpt2}[arch](torch.bfloat16, 3, layers=4)
    ref = copy.deepcopy(model)
    before = state(model)
    x = prompt(3)
    want = logits(ref, x)
    device: Any = testing.simulated_device(seed=3, max_delay_s=0.001) if where == "simulated" else contextlib.nullcontext()
    kw: dict[str, Any] = {"device": "cpu", **NATIVE_OFF} if where == "device-cpu" else {}
    with device:
        with writes_failing(), pytest.raises(OSError, match=r"No space left on device") as err:
            offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir, prefetch=1, **kw)
        assert err.value.errno == errno.ENOSPC and "writing the page of block 2" in str(err.value)
        assert_as_before(model, before)
        if arch == "gpt2":
            assert model.lm_head.weight is model.transformer.wte.weight
        assert os.listdir(nvme_dir) == []
        h = offload_adam.offload_weights(model, storage="nvme", nvme_dir=nvme_dir, prefetch=1, **kw)
        assert torch.equal(logits(model, x), want)
        h.close()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_a_write_error_filling_an_empty_model_from_a_checkpoint_leaves_it_empty(tmp_path: Any, nvme_dir: str) -> None:
    """A model built with init_empty_weights, filled from a checkpoint: the write error leaves its
    parameters the meta ones they were (the same objects, untied as it came: the offload's
    tie_weights() is undone too); the next offload loads it exactly."""
    accelerate = pytest.importorskip("accelerate")
    from safetensors.torch import save_model

    model = gpt2(torch.float32, 4, layers=3)
    ckpt = tmp_path / "model.safetensors"
    save_model(model, str(ckpt))
    with accelerate.init_empty_weights():
        empty = type(model)(model.config).eval()  # (untied: init_empty_weights re-creates each parameter)
    assert empty.lm_head.weight is not empty.transformer.wte.weight
    before = state(empty)
    x = prompt(4)
    want = logits(model, x)
    with writes_failing(), pytest.raises(OSError, match=r"writing the page of block 2 .*No space left on device"):
        offload_adam.offload_weights(empty, device="cpu", storage="nvme", nvme_dir=nvme_dir, checkpoint=ckpt, **NATIVE_OFF)
    assert_as_before(empty, before)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert empty.lm_head.weight is not empty.transformer.wte.weight
    assert os.listdir(nvme_dir) == []
    h = offload_adam.offload_weights(empty, device="cpu", storage="nvme", nvme_dir=nvme_dir, checkpoint=ckpt, **NATIVE_OFF)
    assert torch.equal(logits(empty, x), want)
    h.close()


@pytest.mark.parametrize("storage, kind", [("cpu", "fp32"), ("nvme", "fp32"), ("cpu", "int8")])
def test_a_failure_after_every_block_is_stored_puts_back_every_weight(storage: str, kind: str, nvme_dir: str, monkeypatch: Any) -> None:
    """The device out of memory for the streaming ring, after every block is stored: blocks
    resident on the device, blocks in the pinned host copy (whose own tensors were freed as
    they were copied: they come back from it), blocks on NVMe, the buffers moved to the device,
    all as they were, quantized ones (torchao's int8: their inner tensors) too; the next
    offload is exact."""
    from offload_adam.weights import streamer

    model = llama(torch.float32 if kind == "fp32" else torch.bfloat16, 5, layers=4)
    if kind == "int8":
        torchao_q = pytest.importorskip("torchao.quantization")
        torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig())
    ref = copy.deepcopy(model)
    before = state(model)
    x = prompt(5)
    want = logits(ref, x)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    kw: dict[str, Any] = {"storage": storage, "gpu_budget_gb": 0.5 * total / 2**30, "prefetch": 1}
    if storage == "nvme":
        kw["nvme_dir"] = nvme_dir

    class OutOfMemory(streamer.Ring):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate the streaming ring")

    with testing.simulated_device(seed=5, max_delay_s=0.001):
        with monkeypatch.context() as mp:
            mp.setattr(streamer, "Ring", OutOfMemory)
            with pytest.raises(torch.OutOfMemoryError, match="the streaming ring"):
                offload_adam.offload_weights(model, **kw, **NATIVE_OFF)
        assert_as_before(model, before)
        assert os.listdir(nvme_dir) == []
        h = offload_adam.offload_weights(model, **kw, **NATIVE_OFF)
        assert 0 < len(h.resident) < len(h.blocks)  # (both kinds of blocks were there)
        assert torch.equal(logits(model, x), want)
        h.close()
