"""The float64 reference of ``_native.experts`` and the kernel's stated bound (``rust/linear/experts.rs``).

:func:`reference` evaluates ``out[r] = sum_j weights[r, j] * down_u(act(gate) * up)`` exactly (in
float64, on the inputs as given: bfloat16 activations and weights as their values, int8 / fp8
weights times their scales) and returns, beside it, the bound every path of the kernel is held
to, element by element. A test of a model's experts checks each expert's result against it:
``(out.double() - y).abs() <= bound``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

U = 2.0**-24
# A bound of |act'| (SiLU 1.0998, GELU-tanh 1.129) and the float32 evaluation's error of an
# activation, as multiples of u (|act(t)| + |t|).
LIPSCHITZ = 1.13
ACT_ULPS = 8.0


def _gamma(m: Tensor) -> Tensor:
    return m * U / (1 - m * U)


def _linear_bound(k: int, abs_sum: Tensor) -> Tensor:
    """``rust/linear``'s ``error_bound`` of a float32 output: ``gamma_(k+4) * abs_sum``."""
    m = (k + 4) * U
    return m / (1 - m) * abs_sum


def _act64(t: Tensor, act: str) -> Tensor:
    if act == "silu":
        return t / (1 + torch.exp(-t))
    if act == "gelu_tanh":
        return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
    raise ValueError(f"act: must be 'silu' or 'gelu_tanh', got {act!r}")


def _dequant(w: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(w, |scale|)`` in float64, the scale one per output row."""
    s = torch.ones(w.shape[0], dtype=torch.float64) if scale is None else scale.double().reshape(-1).expand(w.shape[0])
    return w.double(), s


def reference(
    x: Tensor,
    gate_up: Sequence[Tensor],
    down: Sequence[Tensor],
    index: Tensor,
    weights: Tensor,
    *,
    gate_up_scale: Sequence[Tensor] | None = None,
    down_scale: Sequence[Tensor] | None = None,
    act: str = "silu",
) -> tuple[Tensor, Tensor]:
    """``(y, bound)``, both ``[rows, hidden]`` float64: the exact result of ``_native.experts``'s
    formula and the bound of ``rust/linear/experts.rs`` (a bfloat16 ``x`` adds the output's
    rounding). Arguments as ``_native.experts``'s."""
    rows, hidden = x.shape
    k = index.shape[1]
    x64 = x.double()
    y = torch.zeros(rows, hidden, dtype=torch.float64)
    abs_o = torch.zeros_like(y)
    err_o = torch.zeros_like(y)
    valid = torch.zeros(rows, dtype=torch.float64)
    for r in range(rows):
        for j in range(k):
            u = int(index[r, j])
            if u < 0:
                continue
            valid[r] += 1
            w = float(weights[r, j].double())
            gu, gs = _dequant(gate_up[u], None if gate_up_scale is None else gate_up_scale[u])
            dn, ds = _dequant(down[u], None if down_scale is None else down_scale[u])
            inter = gu.shape[0] // 2
            prod = gu * x64[r]
            gv = prod.sum(1) * gs
            agv = prod.abs().sum(1) * gs.abs()
            g, v = gv[:inter], gv[inter:]
            eg, ev = _linear_bound(hidden, agv[:inter]), _linear_bound(hidden, agv[inter:])
            a = _act64(g, act)
            ea = LIPSCHITZ * eg + ACT_ULPS * U * (a.abs() + g.abs() + (LIPSCHITZ + 1) * eg)
            h = a * v
            eh = ea * (v.abs() + ev) + a.abs() * ev + U * (a.abs() + ea) * (v.abs() + ev)
            yv = (dn @ h) * ds
            ey = _linear_bound(inter, (dn.abs() @ (h.abs() + eh)) * ds.abs()) + (dn.abs() @ eh) * ds.abs()
            y[r] += w * yv
            abs_o[r] += abs(w) * (yv.abs() + ey)
            err_o[r] += abs(w) * ey
    bound = _gamma(valid + 1)[:, None] * abs_o + err_o
    if x.dtype == torch.bfloat16:
        bound = bound + (y.abs() + bound) * 2.0**-8
    return y, bound
