"""Lightning, from the registry: its optimizer wrapper and its Trainer with bf16-mixed precision
and gradient clipping, on CPU parameters and offloaded ones (the model on the simulated device,
put there by the Trainer through the test aids' accelerator, as on a GPU), against
torch.optim.AdamW under the same Trainer."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import offload_adam
from offload_adam import testing

L = pytest.importorskip("lightning")
from offload_adam.testing import simlightning  # noqa: E402 (it imports lightning)


def test_lightning_optimizer_wrapper_forwards_state_and_state_dict() -> None:
    """LightningOptimizer takes our class without our instance dict: a missing attribute must be
    an AttributeError (it forwards those), not a KeyError."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = offload_adam.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    lo = LightningOptimizer(opt)
    assert lo.state is opt.state and len(lo.state) == 2
    sd, ref = lo.state_dict(), opt.state_dict()
    assert sd["param_groups"] == ref["param_groups"]
    assert all(torch.equal(sd["state"][0][k], ref["state"][0][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


class _Tiny(L.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self, make_opt: Callable[..., Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.make_opt = make_opt
        self.seen: set[torch.device] = set()  # where the batches and the weights were in training

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x, y = batch
        self.seen |= {x.device, *(p.device for p in self.parameters())}
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return self.make_opt(self.net.parameters(), lr=1e-2, weight_decay=0.1)


def _fit(make_opt: Callable[..., Any], precision: str) -> list[torch.Tensor]:
    """Trained on the CPU, or inside ``simulated_device()`` on it (the Trainer moves the model and
    the batches there); the weights on the host."""
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    model = _Tiny(make_opt)
    sim = testing.active_device()
    where: dict[str, Any] = (
        {"precision": precision, "accelerator": "cpu", "devices": 1} if sim is None else simlightning.trainer_kwargs(sim.torch_device, precision)
    )
    trainer = L.Trainer(
        max_steps=12, gradient_clip_val=0.05, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **where,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=8))
    opt = trainer.optimizers[0]
    if isinstance(opt, offload_adam.AdamW):
        opt.synchronize()
    assert model.seen == {torch.device("cpu") if sim is None else sim.torch_device}  # (offloaded: as on "cuda")
    return [p.detach().cpu() for p in model.net.parameters()]


@pytest.mark.parametrize("where", ["cpu", "offloaded"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_trainer_clips_with_our_optimizer_as_with_torchs(where: str, precision: str) -> None:
    """Lightning refused to clip ("does not allow for gradient clipping") for an optimizer that
    declares _step_supports_amp_scaling, which ours did always; torch's AdamW clips (the same
    Trainer on the same device: offloaded, both on the simulated device)."""
    with testing.simulated_device(seed=0, max_delay_s=0.001) if where == "offloaded" else contextlib.nullcontext() as sim:
        ref = _fit(torch.optim.AdamW, precision)
        ours = _fit(offload_adam.AdamW, precision)
    if sim is not None:
        assert sim.violations == []
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
