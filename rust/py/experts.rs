//! `experts`: the routed experts of a mixture-of-experts layer in one call (`crate::linear::experts`),
//! on the tensors as they are (no copy), checked first: every error names the argument.

use pyo3::prelude::*;

use super::convert::{err, pool, simd_or_default, type_error, value_error};
use super::dlpack::{Elems, HostView, HostViewMut};
use super::linear::act_mut;
use crate::linear::experts::{self as core, Activation, Expert, ExpertsShape};
use crate::linear::{Act, Scale, Weight};

fn act_of<'a>(v: &HostView<'a, '_>, name: &str) -> PyResult<Act<'a>> {
    match v.elems() {
        Elems::F32(x) => Ok(Act::F32(x)),
        Elems::Bf16(x) => Ok(Act::Bf16(x)),
        _ => Err(type_error(format!("{name}: dtype must be float32 or bfloat16"))),
    }
}

/// A list argument's items (a list or a tuple of tensors).
fn items<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if obj.is_instance_of::<pyo3::types::PyList>() || obj.is_instance_of::<pyo3::types::PyTuple>() {
        obj.try_iter()?.collect()
    } else {
        Err(type_error(format!(
            "{name}: expected a list of tensors (one per expert), got {}",
            obj.get_type().name()?
        )))
    }
}

/// A list of per-expert scales (None: no list), `n` of them.
fn scales<'py>(obj: Option<&Bound<'py, PyAny>>, name: &str, n: usize) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
    let Some(o) = obj else { return Ok(None) };
    if o.is_none() {
        return Ok(None);
    }
    let v = items(o, name)?;
    if v.len() != n {
        return Err(value_error(format!(
            "{name}: has {} scales, gate_up has {n} experts",
            v.len()
        )));
    }
    Ok(Some(v))
}

/// The views of tensors, each named by `names`.
fn views<'a, 'py>(objs: &'a [Bound<'py, PyAny>], names: &[String]) -> PyResult<Vec<HostView<'a, 'py>>> {
    objs.iter().zip(names).map(|(o, name)| HostView::new(o, name)).collect()
}

/// The weight `name` of 2-D shape `(n, k)` with its scale (`scale_name`), as the kernel reads it.
fn weight<'a>(
    w: &HostView<'a, '_>,
    s: Option<&HostView<'a, '_>>,
    name: &str,
    scale_name: &str,
    n: usize,
    k: usize,
) -> PyResult<Weight<'a>> {
    if w.shape != [n, k] {
        return Err(value_error(format!(
            "{name}: shape must be ({n}, {k}), got {:?}",
            w.shape
        )));
    }
    let scale = || -> PyResult<Scale<'a>> {
        let s = s.ok_or_else(|| value_error(format!("{scale_name}: required for quantized weights")))?;
        if s.numel != n && s.numel != 1 {
            return Err(value_error(format!(
                "{scale_name}: has {} elements, expected one per output row ({n}) or one for the tensor",
                s.numel
            )));
        }
        match s.elems() {
            Elems::F32(s) => Ok(Scale::F32(s)),
            Elems::Bf16(s) => Ok(Scale::Bf16(s)),
            Elems::F16(s) => Ok(Scale::F16(s)),
            _ => Err(type_error(format!(
                "{scale_name}: dtype must be float32, bfloat16 or float16"
            ))),
        }
    };
    match w.elems() {
        Elems::Bf16(w) => {
            if s.is_some() {
                return Err(value_error(format!("{scale_name}: bfloat16 weights take no scale")));
            }
            Ok(Weight::Bf16(w))
        }
        Elems::I8(q) => Ok(Weight::Int8 { q, scale: scale()? }),
        Elems::F8E4M3(q) => Ok(Weight::Fp8 { q, scale: scale()? }),
        _ => Err(type_error(format!(
            "{name}: dtype must be bfloat16, int8 or float8_e4m3fn"
        ))),
    }
}

/// `out[r] = sum over j of weights[r, j] * down[u](act(gate) * up)` with `[gate; up] =
/// gate_up[u] @ x[r]` and `u = index[r, j]` (`-1`: skipped): the routed experts of one
/// mixture-of-experts layer in one call. `x` is `(rows, hidden)` float32 or bfloat16;
/// `gate_up` a list of `U` tensors `(2 * intermediate, hidden)` (gate rows, then up rows), `down`
/// a list of `U` tensors `(hidden, intermediate)`, each list of one format: bfloat16 (no scales),
/// or int8 / float8_e4m3fn with `gate_up_scale` / `down_scale` lists of per-output-row scales
/// (float32, bfloat16 or float16; one per row or one per tensor). `index` is `(rows, k)` int64 in
/// `[0, U)` or `-1`; `weights` `(rows, k)` float32 or bfloat16. `out` (`(rows, hidden)`, `x`'s
/// dtype, sharing no memory with any input) is overwritten. `act` is `"silu"` or `"gelu_tanh"`.
/// Every tensor is a contiguous CPU tensor. Only the experts `index` names are checked and read:
/// the lists' other entries are not looked at (any object: `None` for an expert not here). Runs
/// on `num_threads` threads, GIL released (`omp`: on the process's OpenMP team, as `linear`'s;
/// the same bits).
#[pyfunction]
#[pyo3(signature = (x, gate_up, down, index, weights, *, gate_up_scale=None, down_scale=None, out, act="silu", num_threads=1, simd=None, omp=false))]
pub fn experts<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    gate_up: &Bound<'py, PyAny>,
    down: &Bound<'py, PyAny>,
    index: &Bound<'py, PyAny>,
    weights: &Bound<'py, PyAny>,
    gate_up_scale: Option<&Bound<'py, PyAny>>,
    down_scale: Option<&Bound<'py, PyAny>>,
    out: &Bound<'py, PyAny>,
    act: &str,
    num_threads: usize,
    simd: Option<&str>,
    omp: bool,
) -> PyResult<()> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let activation = Activation::parse(act).map_err(err)?;
    let xv = HostView::new(x, "x")?;
    let &[rows, hidden] = xv.shape.as_slice() else {
        return Err(value_error(format!(
            "x: must be 2-D (rows, hidden), got shape {:?}",
            xv.shape
        )));
    };
    let gu_objs = items(gate_up, "gate_up")?;
    let dn_objs = items(down, "down")?;
    let n = gu_objs.len();
    if dn_objs.len() != n {
        return Err(value_error(format!(
            "down: has {} experts, gate_up has {n}",
            dn_objs.len()
        )));
    }
    let gus_objs = scales(gate_up_scale, "gate_up_scale", n)?;
    let dns_objs = scales(down_scale, "down_scale", n)?;
    let iv = HostView::new(index, "index")?;
    let &[irows, k] = iv.shape.as_slice() else {
        return Err(value_error(format!(
            "index: must be 2-D (rows, k), got shape {:?}",
            iv.shape
        )));
    };
    if irows != rows {
        return Err(value_error(format!("index: has {irows} rows, x has {rows}")));
    }
    let Elems::I64(idx) = iv.elems() else {
        return Err(type_error("index: dtype must be int64"));
    };
    // Only the experts the index names are checked and read (a layer's list holds them all, a
    // call reads a few; a view costs microseconds): they become the core's experts 0.., in order.
    if let Some(p) = idx.iter().position(|&v| v < -1 || v >= n as i64) {
        return Err(value_error(format!(
            "index: {} at ({}, {}) is outside [0, {n}) (the experts given) and not -1 (skip)",
            idx[p],
            p / k.max(1),
            p % k.max(1)
        )));
    }
    let mut named = vec![usize::MAX; n];
    for &v in idx.iter().filter(|&&v| v >= 0) {
        named[v as usize] = 0;
    }
    let used: Vec<usize> = (0..n).filter(|&u| named[u] == 0).collect();
    for (i, &u) in used.iter().enumerate() {
        named[u] = i;
    }
    let local: Vec<i64> = idx
        .iter()
        .map(|&v| if v < 0 { -1 } else { named[v as usize] as i64 })
        .collect();
    let pick = |objs: &Option<Vec<Bound<'py, PyAny>>>| -> Option<Vec<Bound<'py, PyAny>>> {
        objs.as_ref().map(|v| used.iter().map(|&u| v[u].clone()).collect())
    };
    let gu_used: Vec<Bound<'py, PyAny>> = used.iter().map(|&u| gu_objs[u].clone()).collect();
    let dn_used: Vec<Bound<'py, PyAny>> = used.iter().map(|&u| dn_objs[u].clone()).collect();
    let gus_used = pick(&gus_objs);
    let dns_used = pick(&dns_objs);
    let names = |name: &str| -> Vec<String> { used.iter().map(|&u| format!("{name}[{u}]")).collect() };
    let (gu_names, dn_names) = (names("gate_up"), names("down"));
    let (gus_names, dns_names) = (names("gate_up_scale"), names("down_scale"));
    let guv = views(&gu_used, &gu_names)?;
    let dnv = views(&dn_used, &dn_names)?;
    let gusv = gus_used.as_deref().map(|o| views(o, &gus_names)).transpose()?;
    let dnsv = dns_used.as_deref().map(|o| views(o, &dns_names)).transpose()?;
    let inter = match guv.first().map(|v| v.shape.as_slice()) {
        None => 0,
        Some(&[two_i, _]) if two_i % 2 == 0 => two_i / 2,
        Some(s) => {
            return Err(value_error(format!(
                "{}: shape must be (2 * intermediate, hidden), got {s:?}",
                gu_names[0]
            )))
        }
    };
    for (names, vs) in [(&gu_names, &guv), (&dn_names, &dnv)] {
        if let Some(i) = vs.iter().position(|v| v.dtype_name() != vs[0].dtype_name()) {
            return Err(type_error(format!(
                "{}: dtype {} differs from {}'s ({}): the experts of a call share one format",
                names[i],
                vs[i].dtype_name(),
                names[0],
                vs[0].dtype_name()
            )));
        }
    }
    let mut list = Vec::with_capacity(used.len());
    for i in 0..used.len() {
        let gs = gusv.as_ref().map(|v| &v[i]);
        let ds = dnsv.as_ref().map(|v| &v[i]);
        list.push(Expert {
            gate_up: weight(&guv[i], gs, &gu_names[i], &gus_names[i], 2 * inter, hidden)?,
            down: weight(&dnv[i], ds, &dn_names[i], &dns_names[i], hidden, inter)?,
        });
    }
    let wv = HostView::new(weights, "weights")?;
    if wv.shape != [rows, k] {
        return Err(value_error(format!(
            "weights: shape must be index's ({rows}, {k}), got {:?}",
            wv.shape
        )));
    }
    let wa = act_of(&wv, "weights")?;
    let xa = act_of(&xv, "x")?;
    let mut reads: Vec<&HostView<'_, '_>> = vec![&xv, &iv, &wv];
    reads.extend(guv.iter());
    reads.extend(dnv.iter());
    reads.extend(gusv.iter().flatten());
    reads.extend(dnsv.iter().flatten());
    let mut ov = HostViewMut::new(HostView::new(out, "out")?, &reads, "out")?;
    if ov.shape() != [rows, hidden] {
        return Err(value_error(format!(
            "out: shape must be x's ({rows}, {hidden}), got {:?}",
            ov.shape()
        )));
    }
    let o = act_mut(&mut ov);
    let shape = ExpertsShape { rows, hidden, inter, k };
    let omp = omp.then_some(num_threads);
    py.detach(|| core::experts_on(simd, omp, pool.as_deref(), shape, xa, &list, &local, wa, activation, o))
        .map_err(err)
}
