"""The arguments of :func:`~offload_adam.offload_weights` that a configuration ignores, refused
or warned of, naming them, before anything changes (issue 37, point 5).

One rule per row of :data:`RULES`: where it applies (the model run on the CPU, every block
streamed to a GPU, ...), the argument it ignores there, whether that is an error (the caller
clearly expected an effect: a budget of GPU memory on a machine that runs the model on its
CPU) or a warning (harmless: the result is the same as without it), and why. An argument at its
default is never named: only what the caller wrote can be ignored. The values reach this table
checked (their types and ranges: ``offload_weights`` checks those first)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

# offload_weights' defaults of the arguments the rules read: a value equal to its default was
# not asked for (prefetch=2 written out is the default, and changes nothing anywhere).
DEFAULTS: dict[str, Any] = {
    "gpu_budget_gb": None,
    "placement": "stream",
    "cost_model": None,
    "native_matmul": None,
    "prefetch": 2,
}


@dataclass(frozen=True)
class Rule:
    """``argument`` is ignored where ``applies(config)`` holds; ``error``: refused (ValueError),
    else a warning; ``why``: what happens instead, for the message."""

    argument: str
    applies: Callable[[dict[str, Any]], bool]
    error: bool
    why: str


def _on_host(c: dict[str, Any]) -> bool:
    return bool(c["on_host"])


RULES: tuple[Rule, ...] = (
    Rule(
        "gpu_budget_gb", _on_host, True,
        "the model runs on the CPU (device='cpu', or no GPU): there is no GPU memory to budget; "
        "with storage='nvme' the RAM kept for whole blocks is host_budget_gb",
    ),
    Rule(
        "placement", lambda c: c["on_host"] and c["placement"] == "auto", False,
        "the model runs on the CPU (device='cpu', or no GPU): every block runs there, placement='cpu' is the only one",
    ),
    Rule(
        "cost_model", lambda c: c["placement"] != "auto" or c["on_host"], False,
        "only placement='auto' on a GPU weighs calls with a cost model",
    ),
    Rule(
        "native_matmul", lambda c: not c["on_host"] and c["placement"] == "stream" and c["native_matmul"], False,
        "with placement='stream' on a GPU every block runs there, never on the CPU: torch's kernels run every matmul",
    ),
    Rule(
        "prefetch", lambda c: c["on_host"] and c["storage"] == "cpu", False,
        "device='cpu' with storage='cpu' keeps every block in RAM: nothing is read ahead",
    ),
)


def check(*, on_host: bool, storage: str, **given: Any) -> None:
    """Refuses (``ValueError``) or warns of each argument in ``given`` (offload_weights' own
    values, by name) that this configuration ignores: ``on_host`` (the CPU runs the model) and
    ``storage``, with ``placement`` among ``given``. Every error is raised before any warning is
    given, and nothing is changed either way."""
    config = {"on_host": on_host, "storage": storage, **given}
    hits = [r for r in RULES if r.argument in given and given[r.argument] != DEFAULTS[r.argument] and r.applies(config)]
    for r in hits:
        if r.error:
            raise ValueError(f"{r.argument}={given[r.argument]!r} would be ignored: {r.why}")
    for r in hits:
        warnings.warn(f"offload_weights: {r.argument}={given[r.argument]!r} is ignored: {r.why}", stacklevel=3)
