"""Lightning on the simulated device: an accelerator for ``simgpu``, so that a ``Trainer`` puts
the model and its batches there as it puts them on ``"cuda"`` (Lightning has no accelerator for a
device type registered from Python, and its own ones put a model on the CPU or a GPU).

    with testing.simulated_device() as sim:
        trainer = L.Trainer(**simlightning.trainer_kwargs(sim.torch_device, "bf16-mixed"), max_steps=...)

Imported by the tests that use Lightning only (it imports ``lightning``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy

from . import simbackend


class SimulatedAccelerator(Accelerator):  # type: ignore[misc]
    """The accelerator of ``simgpu``: its devices are the simulated devices attached."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != simbackend.NAME:
            raise ValueError(f"device: {device} is not the simulated device's ({simbackend.NAME})")

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        if isinstance(devices, int):
            return list(range(devices))
        return [int(d) for d in devices]

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [simbackend.device(i) for i in SimulatedAccelerator.parse_devices(devices)]

    @staticmethod
    def auto_device_count() -> int:
        return max(simbackend._hooks, default=-1) + 1

    @staticmethod
    def is_available() -> bool:
        return bool(simbackend._hooks)

    @staticmethod
    def name() -> str:
        return simbackend.NAME

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}


def trainer_kwargs(device: torch.device, precision: str = "32-true") -> dict[str, Any]:
    """``Trainer`` arguments that train on ``device`` (a ``simgpu`` device) as on one GPU: the
    accelerator, its one-device strategy and, for ``"bf16-mixed"``/``"16-mixed"``, autocast of
    the device's type (Lightning's own choice would be CUDA's, which does not cast ``simgpu``
    tensors)."""
    acc = SimulatedAccelerator()
    kw: dict[str, Any] = {"strategy": SingleDeviceStrategy(device=device, accelerator=acc)}
    if precision in ("bf16-mixed", "16-mixed"):
        kw["plugins"] = [MixedPrecision(precision, device.type)]  # type: ignore[arg-type]
    else:
        kw["precision"] = precision
    return kw
