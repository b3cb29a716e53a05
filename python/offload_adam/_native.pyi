"""Type stub of the Rust extension ``offload_adam._native`` (checked by ``mypy.stubtest``)."""

from collections.abc import Iterable, Sequence
from typing import Any, final

from torch import Tensor

__all__ = [
    "CHUNK",
    "LANES",
    "QBLOCK",
    "Q8_MIN_NUMEL",
    "IoEngine",
    "IoTicket",
    "StateSet",
    "adam_step",
    "adam_update",
    "grad_accumulate",
    "grad_sq_norm",
    "grads_nonfinite",
    "crc32c",
    "MemoryWindow",
    "io_backend",
    "simd_path",
    "simd_paths",
    "quantize",
    "dequantize",
    "qmap",
    "linear",
    "linear_int4",
    "omp_available",
    "experts",
]

CHUNK: int
LANES: int
QBLOCK: int
Q8_MIN_NUMEL: int

@final
class StateSet:
    """The host state of one param group: flat state buffers and slot layout, with weights written
    in place (``params``) or into the masters, and gradients from ``.grad`` or landing buffers."""

    def __new__(
        cls,
        lens: Sequence[int],
        state_offsets: Sequence[int],
        names: Sequence[str],
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        steps: Tensor,
        master: Tensor | None = None,
        max_exp_avg_sq: Tensor | None = None,
        *,
        params: Sequence[Tensor | None] | None = None,
        landing: Sequence[Tensor | None] | None = None,
        landing_slots: Sequence[tuple[int, int]] | None = None,
        moments: Sequence[tuple[int, int]] | None = None,
        comp: Tensor | None = None,
    ) -> StateSet: ...
    def set_max_exp_avg_sq(self, buf: Tensor) -> None: ...
    @property
    def has_max_exp_avg_sq(self) -> bool: ...
    @property
    def in_place(self) -> bool: ...
    @property
    def grads_landed(self) -> bool: ...
    def __len__(self) -> int: ...
    def check_disjoint(self, others: Sequence[StateSet]) -> None: ...
    def replace_param(self, i: int, p: Tensor) -> None: ...

def adam_step(
    sets: Sequence[StateSet],
    hypers: Sequence[tuple[float, float, float, float, float, bool, bool, bool]],
    selections: Sequence[Sequence[int] | None],
    *,
    num_threads: int,
    grad_scale: float = 1.0,
    bias_correction: bool = True,
    simd: str | None = None,
) -> list[list[int]]: ...
def grad_accumulate(dst: Any, src: Any, *, num_threads: int = 1) -> None: ...
def adam_update(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any | None = None,
    out: Any | None = None,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = ...,  # (0.9, 0.999)
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    amsgrad: bool = False,
    maximize: bool = False,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    num_threads: int = 1,
    simd: str | None = None,
) -> None: ...
def grad_sq_norm(tensors: Iterable[Any], *, num_threads: int = 1, simd: str | None = None) -> float: ...
def grads_nonfinite(tensors: Iterable[Any], *, num_threads: int = 1, simd: str | None = None) -> bool: ...
def simd_path() -> str: ...
def simd_paths() -> list[str]: ...
def quantize(src: Tensor, codes: Tensor, absmax: Tensor, *, signed: bool, fp8: bool = False) -> None: ...
def dequantize(codes: Tensor, absmax: Tensor, out: Tensor, *, signed: bool, fp8: bool = False) -> None: ...
def qmap(*, signed: bool) -> list[float]: ...
def linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    out: Tensor,
    num_threads: int = 1,
    simd: str | None = None,
    omp: bool = False,
) -> None: ...
def omp_available() -> bool: ...
def linear_int4(
    x: Tensor,
    qdata: Tensor,
    scale_and_zero: Tensor,
    bias: Tensor | None = None,
    *,
    group_size: int,
    layout: str,
    out: Tensor,
    num_threads: int = 1,
    simd: str | None = None,
    omp: bool = False,
) -> None: ...
def experts(
    x: Tensor,
    gate_up: Sequence[Tensor],
    down: Sequence[Tensor],
    index: Tensor,
    weights: Tensor,
    *,
    gate_up_scale: Sequence[Tensor] | None = None,
    down_scale: Sequence[Tensor] | None = None,
    out: Tensor,
    act: str = "silu",
    num_threads: int = 1,
    simd: str | None = None,
    omp: bool = False,
) -> None: ...

@final
class IoTicket:
    """The completion of one ``IoEngine.submit``."""

    def wait(self) -> None: ...
    def done(self) -> bool: ...

@final
class IoEngine:
    """Reads and writes of tensors' memory at file offsets (io_uring or threads, O_DIRECT)."""

    def __new__(cls, backend: str | None = None, depth: int = 32) -> IoEngine: ...
    @property
    def backend(self) -> str: ...
    def open(self, path: str, size: int) -> int: ...
    def open_read(self, path: str) -> tuple[int, int]: ...
    def direct(self, file: int) -> bool: ...
    def close_file(self, file: int) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def submit(self, requests: Sequence[tuple[bool, int, Any, int]]) -> IoTicket: ...
    def inject_fault(self, op: str, errno: int, after: int = 0) -> None: ...
    def bytes(self) -> tuple[int, int]: ...

def crc32c(tensor: Any) -> int: ...
def io_backend() -> str: ...

@final
class MemoryWindow:
    """The NVMe tier's RAM window: memory moved under tensors' pages while they are resident
    (``map``), and parked again for the next lease (``unmap``)."""

    def __new__(cls) -> MemoryWindow: ...
    def map(self, tensors: Sequence[Any]) -> int: ...
    def adopt(self, tensors: Sequence[Any]) -> int: ...
    def set_limit(self, bytes: int) -> None: ...
    def unmap(self, lease: int) -> None: ...
    @property
    def nbytes(self) -> int: ...
