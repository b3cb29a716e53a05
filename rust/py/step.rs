//! `adam_step`: one optimizer step over any number of [`StateSet`]s, in three phases: check
//! ([`check_sets`], [`check_grads`]: nothing touched), carve ([`set_segments`]: each set's
//! buffers cut into the kernel's segments), run with the GIL released and commit
//! ([`commit_steps`]: the step counts). The set itself (its buffers, parameters and their
//! checks) is `state_set.rs`.

use std::sync::MutexGuard;

use pyo3::intern;
use pyo3::prelude::*;

use super::convert::{err, hyper, pool, runtime_error, simd_or_default, value_error, HyperTuple};
use super::dlpack::{carve_sets, Carved, CheckedGrad, DType, GradSpec, Ranges};
use super::state_set::{
    moment_bytes, Inner, MomentCodec, Param, StateSet, COMP, EXP_AVG, EXP_AVG_SQ, LANDING, MASTER, MAX_EXP_AVG_SQ,
    PARAMS, STEPS,
};
use crate::elem::Bf16;
use crate::kernel::{self, Consts, GradRef, HostMut, Hyper, OutMut, Segment, StateMut};
use crate::layout::{carve, Layout, Slot, KINDS};

/// One optimizer step over `sets`, each with the hyper-parameters `hypers[i]` and the slots
/// `selections[i]` (None: every slot whose parameter has a `.grad`; required for sets whose
/// gradients come from landing buffers). Everything is checked before anything is written: on
/// error, weights and state are as they were. Returns, per set, the slots stepped for the first
/// time.
///
/// Three phases: [`check_sets`] and [`check_grads`] check everything and touch nothing;
/// [`set_segments`] carves each set's buffers into the kernel's segments; the kernel runs with
/// the GIL released, then [`commit_steps`] writes the step counts.
#[pyfunction]
#[pyo3(signature = (sets, hypers, selections, *, num_threads, grad_scale=1.0, bias_correction=true, simd=None))]
pub fn adam_step(
    py: Python<'_>,
    sets: Vec<PyRef<'_, StateSet>>,
    hypers: Vec<HyperTuple>,
    selections: Vec<Option<Vec<usize>>>,
    num_threads: usize,
    grad_scale: f64,
    bias_correction: bool,
    simd: Option<&str>,
) -> PyResult<Vec<Vec<usize>>> {
    if sets.len() != hypers.len() || sets.len() != selections.len() {
        return Err(value_error("sets, hypers and selections: one entry per set"));
    }
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let mut guards = sets.iter().map(|s| s.lock()).collect::<PyResult<Vec<_>>>()?;

    // 1. Check everything, touch nothing.
    let (plans, grads) = check_sets(py, &mut guards, hypers, selections, grad_scale, bias_correction)?;
    let mut checked = check_grads(&mut guards, &plans, &grads)?;

    // 2. The kernel's view of the buffers: every slice carved from the imported buffers.
    let mut meta = Vec::with_capacity(sets.len());
    let mut writables = Vec::with_capacity(sets.len());
    for g in guards.iter_mut() {
        let Inner {
            layout,
            names,
            bufs,
            params,
            moments,
            ..
        } = &mut **g;
        meta.push(SetView {
            layout,
            names,
            params: params.as_deref(),
            moments: moments.as_deref(),
        });
        writables.push(bufs);
    }
    let (mut carved, written) = carve_sets(writables)?;
    let mut segments = Vec::new();
    let mut steps = Vec::with_capacity(sets.len());
    for (si, bufs) in carved.iter_mut().enumerate() {
        steps.push(set_segments(
            &meta[si],
            &plans[si],
            bufs,
            &mut checked[si],
            &written,
            &mut segments,
        )?);
    }

    // 3. Run with the GIL released; only a validation error can come back, before any write.
    let pool_ref = pool.as_deref();
    py.detach(move || kernel::adam_step(simd, pool_ref, segments))
        .map_err(err)?;
    let first = commit_steps(steps, &plans);
    drop(checked);
    drop(grads);
    Ok(first)
}

/// Phase 1's verdict on one set: what its step does.
struct Plan {
    hyper: Hyper,
    /// The slots to step, in order.
    slots: Vec<usize>,
}

/// The gradients a step reads from the parameters' `.grad`, each with its (set, slot).
struct DotGrads<'py> {
    tensors: Vec<Bound<'py, PyAny>>,
    owners: Vec<(usize, usize)>,
}

/// Phase 1: the hyper-parameters, the selections, replaced storages (re-bound), and which slots
/// have a gradient. Touches no buffer.
fn check_sets<'py>(
    py: Python<'py>,
    guards: &mut [MutexGuard<'_, Inner>],
    hypers: Vec<HyperTuple>,
    selections: Vec<Option<Vec<usize>>>,
    grad_scale: f64,
    bias_correction: bool,
) -> PyResult<(Vec<Plan>, DotGrads<'py>)> {
    let mut plans = Vec::with_capacity(guards.len());
    let mut grads = DotGrads {
        tensors: Vec::new(),
        owners: Vec::new(),
    };
    for (si, (inner, (h, sel))) in guards.iter_mut().zip(hypers.into_iter().zip(selections)).enumerate() {
        let h = hyper(h, &format!("param group {si}"), grad_scale, bias_correction)?;
        if h.amsgrad && inner.bufs.get(MAX_EXP_AVG_SQ).is_none() {
            return Err(runtime_error(format!(
                "param group {si}: amsgrad needs a max_exp_avg_sq buffer"
            )));
        }
        let idx = match sel {
            Some(v) => {
                inner.layout.check_selection(&v).map_err(err)?;
                v
            }
            None if inner.grads.is_some() => (0..inner.layout.len()).collect(),
            None => return Err(value_error("selections: required for gradients from landing buffers")),
        };
        let mut keep = Vec::with_capacity(idx.len());
        for i in idx {
            inner.rebind_if_replaced(py, i)?;
            if inner.grads.is_some() {
                let params = inner.params.as_ref().expect("gradients from .grad need params");
                let p = params[i].as_ref().expect("gradients from .grad: every slot in place");
                let g = p.param.bind(py).getattr(intern!(py, "grad"))?;
                if g.is_none() {
                    continue;
                }
                grads.tensors.push(g);
                grads.owners.push((si, i));
            }
            keep.push(i);
        }
        plans.push(Plan { hyper: h, slots: keep });
    }
    Ok((plans, grads))
}

/// Phase 1, the gradients read from `.grad`: dtype, layout and size against their parameters
/// (cached: the same gradient at the same address is not checked again). Per set, per planned
/// slot, its checked gradient (None: from a landing buffer).
fn check_grads<'a, 'py>(
    guards: &mut [MutexGuard<'_, Inner>],
    plans: &[Plan],
    grads: &'a DotGrads<'py>,
) -> PyResult<Vec<Vec<Option<CheckedGrad<'a, 'py>>>>> {
    let mut checked: Vec<Vec<Option<CheckedGrad<'a, 'py>>>> =
        plans.iter().map(|p| p.slots.iter().map(|_| None).collect()).collect();
    let mut pos: Vec<usize> = vec![0; plans.len()];
    for (g, &(si, i)) in grads.tensors.iter().zip(&grads.owners) {
        let inner: &mut Inner = &mut guards[si];
        while plans[si].slots[pos[si]] != i {
            pos[si] += 1;
        }
        let Inner {
            params, names, grads, ..
        } = inner;
        let p = params.as_ref().expect("in place")[i]
            .as_ref()
            .expect("every slot in place");
        let spec = GradSpec {
            name: &names[i],
            numel: p.numel,
            complex: p.complex,
            strides: p.strides.as_deref(),
        };
        let c = grads.as_mut().expect("from .grad").check(i, g, &spec)?;
        checked[si][pos[si]] = Some(c);
    }
    Ok(checked)
}

/// What phase 2 reads of a set besides its buffers.
struct SetView<'s> {
    layout: &'s Layout,
    names: &'s [String],
    params: Option<&'s [Option<Param>]>,
    moments: Option<&'s [(usize, MomentCodec)]>,
}

impl SetView<'_> {
    /// The parameter slot `i` writes in place, if any.
    fn own(&self, i: usize) -> Option<&Param> {
        self.params.and_then(|ps| ps[i].as_ref())
    }
}

/// One set's step counts, and their values after the step (per planned slot).
type Steps<'b> = (&'b mut [f32], Vec<f32>);

/// Phase 2 for one set: its buffers `bufs` carved into one [`Segment`] per planned slot,
/// appended to `out`. `written`: every byte the step writes, which no gradient may share.
fn set_segments<'b, 't: 'b>(
    set: &SetView<'_>,
    plan: &Plan,
    bufs: &mut Carved<'b>,
    checked: &mut [Option<CheckedGrad<'t, '_>>],
    written: &Ranges,
    out: &mut Vec<Segment<'b>>,
) -> PyResult<Steps<'b>> {
    let sel = &plan.slots;
    let h = &plan.hyper;
    let slots = set.layout.slots();
    for (j, c) in checked.iter().enumerate() {
        if let Some(c) = c {
            let (lo, hi) = c.range();
            if crate::layout::overlaps(written, lo, hi) {
                return Err(value_error(format!(
                    "{}: gradient shares memory with a parameter or the optimizer's state",
                    set.names[sel[j]]
                )));
            }
        }
    }
    let ranges: Vec<(usize, usize)> = sel.iter().map(|&i| (slots[i].state, slots[i].len)).collect();
    let items: Option<Vec<(usize, usize, MomentCodec)>> = set
        .moments
        .map(|mo| sel.iter().map(|&i| (mo[i].0, slots[i].len, mo[i].1)).collect());
    let moment = |b: Option<HostMut<'b>>, what: &str| match &items {
        Some(items) => carve_moments(b, items, what),
        None => carve_state(b, &ranges, what),
    };
    let mut m = moment(bufs[EXP_AVG].take(), "exp_avg")?.into_iter();
    let mut v = moment(bufs[EXP_AVG_SQ].take(), "exp_avg_sq")?.into_iter();
    let mut x = if h.amsgrad {
        Some(moment(bufs[MAX_EXP_AVG_SQ].take(), "max_exp_avg_sq")?.into_iter())
    } else {
        None
    };
    let has_comp = bufs[COMP].is_some();
    let kahan = |i: usize| has_comp && set.own(i).is_some_and(|p| p.dtype == DType::Bf16);
    let uses_master = |i: usize| set.own(i).is_none_or(|p| p.dtype != DType::F32) && !kahan(i);
    let mut masters = carve_masters(bufs[MASTER].take(), sel, &ranges, uses_master)?;
    let mut comps = carve_comps(bufs[COMP].take(), sel, &ranges, kahan)?;
    let mut landed = carve_landings(bufs, slots, sel)?;
    let steps = match bufs[STEPS].take() {
        Some(HostMut::F32(s)) => s,
        _ => return Err(runtime_error("steps buffer: missing")),
    };
    let mut last: Option<(u64, Consts)> = None;
    let mut next_steps = Vec::with_capacity(sel.len());
    for (j, &i) in sel.iter().enumerate() {
        let next = steps[i] as u64 + 1;
        next_steps.push(next as f32);
        let consts = match last {
            Some((n, c)) if n == next => c,
            _ => {
                let c = Consts::new(h, next);
                last = Some((next, c));
                c
            }
        };
        let missing = |what: &str| runtime_error(format!("{}: no {what}", set.names[i]));
        let own = match set.own(i) {
            Some(_) => Some(bufs[PARAMS + i].take().ok_or_else(|| missing("parameter memory"))?),
            None => None,
        };
        let grad = checked[j].take().map(|c| c.view());
        let (param, out_copy, grad, kahan_w) =
            slot_io(own, masters[j].take(), comps[j].take(), landed[j].take(), grad, missing)?;
        out.push(Segment {
            consts,
            amsgrad: h.amsgrad,
            param,
            grad,
            exp_avg: m.next().expect("one per slot"),
            exp_avg_sq: v.next().expect("one per slot"),
            max_exp_avg_sq: x.as_mut().map(|x| x.next().expect("one per slot")),
            out: out_copy,
            kahan: kahan_w,
        });
    }
    Ok((steps, next_steps))
}

/// A slot's weights, low-precision copy, gradient and Kahan weights, from what was carved for it:
/// its parameter's memory (`own`: written in place), its master, its compensation, its landing
/// slot and its checked `.grad`. `missing(what)` is the error when one is missing.
#[allow(clippy::type_complexity)]
fn slot_io<'b>(
    own: Option<HostMut<'b>>,
    master: Option<&'b mut [f32]>,
    comp: Option<&'b mut [Bf16]>,
    landing: Option<HostMut<'b>>,
    grad: Option<GradRef<'b>>,
    missing: impl Fn(&str) -> PyErr,
) -> PyResult<(&'b mut [f32], OutMut<'b>, GradRef<'b>, Option<kernel::Kahan<'b>>)> {
    let Some(own) = own else {
        // Into the masters; a low-precision slot's copy goes over the gradient it came in.
        return match (master, landing) {
            (Some(m), Some(l @ (HostMut::Bf16(_) | HostMut::F16(_)))) => Ok((m, as_out(l), GradRef::InOut, None)),
            (Some(m), Some(l)) => Ok((m, OutMut::None, l.into_grad("landing buffer").map_err(err)?, None)),
            (None, _) => Err(missing("master slot")),
            (_, None) => Err(missing("gradient")),
        };
    };
    let mut kahan = None;
    let (param, out) = match (own, master) {
        // In place, float32: the parameter's memory is the master.
        (HostMut::F32(p), _) => (p, OutMut::None),
        // In place, bfloat16 without a master: Kahan compensation.
        (HostMut::Bf16(w), None) if comp.is_some() => {
            kahan = Some(kernel::Kahan {
                w,
                comp: comp.expect("checked"),
            });
            (&mut [][..], OutMut::None)
        }
        // In place, low precision: the master, and the rounded copy into the parameter in the
        // same pass.
        (o, Some(m)) => (m, as_out(o)),
        (_, None) => return Err(missing("master slot")),
    };
    let grad = match (grad, landing) {
        (Some(g), _) => g,
        (None, Some(l)) => l.into_grad("landing buffer").map_err(err)?,
        (None, None) => return Err(missing("gradient")),
    };
    Ok((param, out, grad, kahan))
}

/// The master buffer carved for the planned slots that `use_master` (by slot index), None for
/// the others.
fn carve_masters<'b>(
    b: Option<HostMut<'b>>,
    sel: &[usize],
    ranges: &[(usize, usize)],
    use_master: impl Fn(usize) -> bool,
) -> PyResult<Vec<Option<&'b mut [f32]>>> {
    let pos: Vec<usize> = (0..sel.len()).filter(|&j| use_master(sel[j])).collect();
    let mut out: Vec<Option<&mut [f32]>> = (0..sel.len()).map(|_| None).collect();
    if !pos.is_empty() {
        let r: Vec<(usize, usize)> = pos.iter().map(|&j| ranges[j]).collect();
        for (j, s) in pos.iter().zip(carve_f32(b, &r, "master buffer")?) {
            out[*j] = Some(s);
        }
    }
    Ok(out)
}

/// The Kahan compensation buffer carved for the planned slots with `kahan` weights.
fn carve_comps<'b>(
    b: Option<HostMut<'b>>,
    sel: &[usize],
    ranges: &[(usize, usize)],
    kahan: impl Fn(usize) -> bool,
) -> PyResult<Vec<Option<&'b mut [Bf16]>>> {
    let pos: Vec<usize> = (0..sel.len()).filter(|&j| kahan(sel[j])).collect();
    let mut out: Vec<Option<&mut [Bf16]>> = (0..sel.len()).map(|_| None).collect();
    if !pos.is_empty() {
        let r: Vec<(usize, usize)> = pos.iter().map(|&j| ranges[j]).collect();
        let Some(HostMut::Bf16(b)) = b else {
            return Err(runtime_error("Kahan compensation buffer: missing"));
        };
        for (j, c) in pos.iter().zip(carve(b, &r).map_err(err)?) {
            out[*j] = Some(c);
        }
    }
    Ok(out)
}

/// The landing buffers carved for the planned slots whose gradients land there.
fn carve_landings<'b>(bufs: &mut Carved<'b>, slots: &[Slot], sel: &[usize]) -> PyResult<Vec<Option<HostMut<'b>>>> {
    let mut out: Vec<Option<HostMut<'_>>> = (0..sel.len()).map(|_| None).collect();
    for k in 0..KINDS {
        let pos: Vec<usize> = (0..sel.len())
            .filter(|&j| matches!(slots[sel[j]].landing, Some((kind, _)) if kind == k))
            .collect();
        if pos.is_empty() {
            continue;
        }
        let r: Vec<(usize, usize)> = pos
            .iter()
            .map(|&j| (slots[sel[j]].landing.expect("filtered").1, slots[sel[j]].len))
            .collect();
        for (j, piece) in pos.iter().zip(carve_any(bufs[LANDING + k].take(), &r)?) {
            out[*j] = Some(piece);
        }
    }
    Ok(out)
}

/// Phase 3, after the kernel ran: each set's step counts written; per set, the slots stepped for
/// the first time.
fn commit_steps(steps: Vec<Steps<'_>>, plans: &[Plan]) -> Vec<Vec<usize>> {
    let mut first = Vec::with_capacity(plans.len());
    for ((counts, next), plan) in steps.into_iter().zip(plans) {
        let mut f = Vec::new();
        for (&i, s) in plan.slots.iter().zip(next) {
            counts[i] = s;
            if s == 1.0 {
                f.push(i);
            }
        }
        first.push(f);
    }
    first
}

/// Carves the uint8 moment buffer `b` into the slots `items` (first byte, elements, codec).
fn carve_moments<'a>(
    b: Option<HostMut<'a>>,
    items: &[(usize, usize, MomentCodec)],
    what: &str,
) -> PyResult<Vec<StateMut<'a>>> {
    let Some(HostMut::U8(s)) = b else {
        return Err(runtime_error(format!("{what}: missing")));
    };
    let ranges: Vec<(usize, usize)> = items.iter().map(|&(off, n, q)| (off, moment_bytes(n, q))).collect();
    let misaligned = |_| value_error(format!("{what}: a slot is not on a 4-byte boundary"));
    carve(s, &ranges)
        .map_err(err)?
        .into_iter()
        .zip(items)
        .map(|(piece, &(_, n, q))| {
            Ok(if q.quantized() {
                let (codes, rest) = piece.split_at_mut(n);
                let absmax = bytemuck::try_cast_slice_mut(rest).map_err(misaligned)?;
                if q == MomentCodec::Fp8 {
                    StateMut::Fp8 { codes, scale: absmax }
                } else {
                    StateMut::Q8 { codes, absmax }
                }
            } else {
                StateMut::F32(bytemuck::try_cast_slice_mut(piece).map_err(misaligned)?)
            })
        })
        .collect()
}

/// Carves a state buffer into the slices `ranges` (start, len), in its dtype.
fn carve_state<'a>(b: Option<HostMut<'a>>, ranges: &[(usize, usize)], what: &str) -> PyResult<Vec<StateMut<'a>>> {
    Ok(match b {
        Some(HostMut::F32(s)) => carve(s, ranges).map_err(err)?.into_iter().map(StateMut::F32).collect(),
        Some(HostMut::Bf16(s)) => carve(s, ranges).map_err(err)?.into_iter().map(StateMut::Bf16).collect(),
        Some(HostMut::F16(_) | HostMut::U8(_)) | None => return Err(runtime_error(format!("{what}: missing"))),
    })
}

fn carve_f32<'a>(b: Option<HostMut<'a>>, ranges: &[(usize, usize)], what: &str) -> PyResult<Vec<&'a mut [f32]>> {
    match b {
        Some(HostMut::F32(s)) => carve(s, ranges).map_err(err),
        _ => Err(runtime_error(format!("{what}: missing"))),
    }
}

fn carve_any<'a>(b: Option<HostMut<'a>>, ranges: &[(usize, usize)]) -> PyResult<Vec<HostMut<'a>>> {
    Ok(match b {
        Some(HostMut::F32(s)) => carve(s, ranges).map_err(err)?.into_iter().map(HostMut::F32).collect(),
        Some(HostMut::Bf16(s)) => carve(s, ranges).map_err(err)?.into_iter().map(HostMut::Bf16).collect(),
        Some(HostMut::F16(s)) => carve(s, ranges).map_err(err)?.into_iter().map(HostMut::F16).collect(),
        Some(HostMut::U8(_)) | None => return Err(runtime_error("landing buffer: missing")),
    })
}

fn as_out(h: HostMut<'_>) -> OutMut<'_> {
    match h {
        HostMut::F32(_) | HostMut::U8(_) => OutMut::None,
        HostMut::Bf16(s) => OutMut::Bf16(s),
        HostMut::F16(s) => OutMut::F16(s),
    }
}
