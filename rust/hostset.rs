//! Host-side state of offloaded (streamed) parameters: every buffer the kernel touches is a flat
//! host buffer owned by the optimizer (fp32 masters, gradient landing buffers in the gradient's
//! dtype, low-precision weight copies for the host-to-device transfer, moments, step counts), so
//! a step reads no torch tensor at all: the Python layer streams gradients in and weights out.

use std::sync::Mutex;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rayon::prelude::*;

use crate::bindings::{
    check_disjoint, grad_ref, hyper, import_max_exp_avg_sq, install, pool, simd_or_default, slice_mut, state_mut,
    GradInfo,
};
use crate::dlpack::{DType, Import};
use crate::elem::{Bf16, Elem, F16};
use crate::kernel::{self, Consts, GradRef, OutMut, Segment};

const KINDS: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

struct Slot {
    /// Offset in the state buffers (exp_avg, exp_avg_sq, max_exp_avg_sq, master).
    state: usize,
    len: usize,
    /// Which gradient buffer (index in KINDS), and the offset in it; a bf16/f16 parameter's
    /// weight copy sits at the same offset of the out buffer of its dtype.
    kind: usize,
    grad: usize,
}

/// The flat host buffers of one streamed param group.
#[pyclass(module = "offload_adam._native", frozen)]
pub struct HostSet {
    slots: Vec<Slot>,
    master: Import,
    exp_avg: Import,
    exp_avg_sq: Import,
    max_exp_avg_sq: Mutex<Option<Import>>,
    steps: Import,
    grads: [Option<Import>; 3],
    outs: [Option<Import>; 3],
    /// Byte ranges of the buffers above, sorted (a later amsgrad buffer must not overlap them).
    writable: Vec<(usize, usize)>,
    busy: Mutex<()>,
}

#[pymethods]
impl HostSet {
    /// `kinds[i]` is 0, 1, 2 for a float32, bfloat16, float16 parameter (its gradient dtype);
    /// `grads[k]`/`outs[k]` are the landing buffers and (k > 0) weight-copy buffers of kind k.
    /// Without `outs[k]`, the landing buffer of kind k also receives the weight copy (the
    /// kernel reads a block's gradient, then overwrites it with the block's new weights).
    #[new]
    #[pyo3(signature = (state_offsets, lens, kinds, grad_offsets, master, exp_avg, exp_avg_sq, steps, grads, outs, max_exp_avg_sq=None))]
    fn new(
        state_offsets: Vec<usize>,
        lens: Vec<usize>,
        kinds: Vec<usize>,
        grad_offsets: Vec<usize>,
        master: &Bound<'_, PyAny>,
        exp_avg: &Bound<'_, PyAny>,
        exp_avg_sq: &Bound<'_, PyAny>,
        steps: &Bound<'_, PyAny>,
        grads: Vec<Option<Bound<'_, PyAny>>>,
        outs: Vec<Option<Bound<'_, PyAny>>>,
        max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<HostSet> {
        let n = lens.len();
        if state_offsets.len() != n
            || kinds.len() != n
            || grad_offsets.len() != n
            || grads.len() != 3
            || outs.len() != 3
        {
            return Err(PyValueError::new_err(
                "HostSet: one offset, length and kind per parameter; three grad and out slots",
            ));
        }
        let master = Import::new(master, "master buffer")?;
        master.require(DType::F32, "master buffer")?;
        let exp_avg = Import::new(exp_avg, "exp_avg buffer")?;
        let exp_avg_sq = Import::new(exp_avg_sq, "exp_avg_sq buffer")?;
        if exp_avg.dtype == DType::F16 {
            return Err(PyTypeError::new_err(
                "exp_avg buffer: state dtype must be float32 or bfloat16",
            ));
        }
        exp_avg_sq.require(exp_avg.dtype, "exp_avg_sq buffer")?;
        let steps = Import::new(steps, "steps buffer")?;
        steps.require(DType::F32, "steps buffer")?;
        if steps.len != n {
            return Err(PyValueError::new_err("steps buffer: one element per parameter"));
        }
        let mut gs: [Option<Import>; 3] = [None, None, None];
        let mut os: [Option<Import>; 3] = [None, None, None];
        for k in 0..3 {
            if let Some(g) = &grads[k] {
                let imp = Import::new(g, &format!("{} gradient buffer", KINDS[k].name()))?;
                imp.require(KINDS[k], "gradient buffer")?;
                gs[k] = Some(imp);
            }
            if let Some(o) = &outs[k] {
                if k == 0 {
                    return Err(PyValueError::new_err(
                        "float32 parameters take their copy from the master buffer",
                    ));
                }
                let imp = Import::new(o, &format!("{} weight-copy buffer", KINDS[k].name()))?;
                imp.require(KINDS[k], "weight-copy buffer")?;
                os[k] = Some(imp);
            }
        }
        let mut slots = Vec::with_capacity(n);
        let mut state_ranges = Vec::new();
        for i in 0..n {
            let (off, len, k, goff) = (state_offsets[i], lens[i], kinds[i], grad_offsets[i]);
            if k > 2 {
                return Err(PyValueError::new_err(format!("parameter {i}: kind must be 0, 1 or 2")));
            }
            let fits = |b: &Import, o: usize| o.checked_add(len).is_some_and(|e| e <= b.len);
            if !fits(&master, off) || !fits(&exp_avg, off) || !fits(&exp_avg_sq, off) {
                return Err(PyValueError::new_err(format!(
                    "parameter {i}: state slot past the end of the buffers"
                )));
            }
            match &gs[k] {
                Some(g) if fits(g, goff) => {}
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "parameter {i}: gradient slot missing or past the end"
                    )))
                }
            }
            if k > 0 && os[k].as_ref().is_some_and(|o| !fits(o, goff)) {
                return Err(PyValueError::new_err(format!(
                    "parameter {i}: weight-copy slot past the end"
                )));
            }
            state_ranges.push((off, off + len, format!("parameter {i}")));
            slots.push(Slot {
                state: off,
                len,
                kind: k,
                grad: goff,
            });
        }
        check_disjoint(state_ranges).map_err(|_| PyValueError::new_err("overlapping state slots"))?;
        for k in 0..3 {
            let r: Vec<_> = slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.kind == k)
                .map(|(i, s)| (s.grad, s.grad + s.len, format!("parameter {i}")))
                .collect();
            check_disjoint(r).map_err(|_| PyValueError::new_err("overlapping gradient slots"))?;
        }
        let mut bufs: Vec<(usize, usize, String)> = vec![
            (master.range().0, master.range().1, "master".into()),
            (exp_avg.range().0, exp_avg.range().1, "exp_avg".into()),
            (exp_avg_sq.range().0, exp_avg_sq.range().1, "exp_avg_sq".into()),
            (steps.range().0, steps.range().1, "steps".into()),
        ];
        for (k, b) in gs.iter().chain(&os).enumerate() {
            if let Some(b) = b {
                bufs.push((b.range().0, b.range().1, format!("buffer {k}")));
            }
        }
        let writable = check_disjoint(bufs)?;
        let set = HostSet {
            slots,
            master,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq: Mutex::new(None),
            steps,
            grads: gs,
            outs: os,
            writable,
            busy: Mutex::new(()),
        };
        if let Some(x) = max_exp_avg_sq {
            set.set_max_exp_avg_sq(x)?;
        }
        Ok(set)
    }

    fn set_max_exp_avg_sq(&self, buf: &Bound<'_, PyAny>) -> PyResult<()> {
        let x = import_max_exp_avg_sq(buf, self.exp_avg.dtype, self.exp_avg.len, &self.writable)?;
        install(&self.max_exp_avg_sq, &self.busy, x)
    }

    #[getter]
    fn has_max_exp_avg_sq(&self) -> bool {
        self.max_exp_avg_sq.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn __len__(&self) -> usize {
        self.slots.len()
    }
}

/// Updates the parameters `indices` of `set` (those that received a gradient) with the
/// hyper-parameters of `group`, reading their landing buffers and writing masters, moments and
/// weight copies. Checks everything first; returns the indices stepped for the first time.
#[pyfunction]
#[pyo3(signature = (set, group, indices, *, num_threads, grad_scale=1.0, bias_correction=true, simd=None))]
pub fn host_step(
    py: Python<'_>,
    set: PyRef<'_, HostSet>,
    group: &Bound<'_, PyDict>,
    indices: Vec<usize>,
    num_threads: usize,
    grad_scale: f64,
    bias_correction: bool,
    simd: Option<&str>,
) -> PyResult<Vec<usize>> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let h = hyper(group, 0, grad_scale, bias_correction)?;
    let _busy = set
        .busy
        .try_lock()
        .map_err(|_| PyRuntimeError::new_err("another step is running on this param group"))?;
    let vmax = set.max_exp_avg_sq.lock().unwrap_or_else(|e| e.into_inner());
    if h.amsgrad && vmax.is_none() {
        return Err(PyRuntimeError::new_err("amsgrad needs a max_exp_avg_sq buffer"));
    }
    let mut seen = vec![false; set.slots.len()];
    for &i in &indices {
        if i >= set.slots.len() || std::mem::replace(&mut seen[i], true) {
            return Err(PyValueError::new_err(format!(
                "indices: {i} is out of range or repeated"
            )));
        }
    }
    let mut segments = Vec::with_capacity(indices.len());
    let mut next_steps = Vec::with_capacity(indices.len());
    for &i in &indices {
        let s = &set.slots[i];
        // SAFETY: one f32 per slot (checked at construction); we hold `busy`.
        let step = unsafe { *(set.steps.ptr() as *const f32).add(i) } as u64 + 1;
        next_steps.push(step as f32);
        let g = set.grads[s.kind].as_ref().expect("checked at construction");
        // SAFETY: every buffer is owned by `set` (alive for the call, `busy` held); slots were
        // checked in bounds and pairwise disjoint per buffer, the buffers disjoint from each
        // other, and `indices` has no repeats: no two slices alias.
        let seg = unsafe {
            let info = GradInfo {
                ptr: g.addr() + s.grad * g.dtype.size(),
                dtype: g.dtype,
            };
            let in_grad = s.kind > 0 && set.outs[s.kind].is_none();
            Segment {
                consts: Consts::new(&h, step),
                amsgrad: h.amsgrad,
                param: slice_mut::<f32>(set.master.ptr(), s.state, s.len),
                grad: if in_grad {
                    GradRef::InOut
                } else {
                    grad_ref(&info, s.len)
                },
                exp_avg: state_mut(&set.exp_avg, s.state, s.len),
                exp_avg_sq: state_mut(&set.exp_avg_sq, s.state, s.len),
                max_exp_avg_sq: if h.amsgrad {
                    vmax.as_ref().map(|x| state_mut(x, s.state, s.len))
                } else {
                    None
                },
                out: match (s.kind, set.outs[s.kind].as_ref().unwrap_or(g)) {
                    (1, o) => OutMut::Bf16(slice_mut::<Bf16>(o.ptr(), s.grad, s.len)),
                    (2, o) => OutMut::F16(slice_mut::<F16>(o.ptr(), s.grad, s.len)),
                    _ => OutMut::None,
                },
            }
        };
        segments.push(seg);
    }
    let pool_ref = pool.as_deref();
    py.detach(move || kernel::adam_step(simd, pool_ref, segments))
        .map_err(PyRuntimeError::new_err)?;
    let mut first = Vec::new();
    for (&i, s) in indices.iter().zip(next_steps) {
        // SAFETY: as above.
        unsafe { *(set.steps.ptr() as *mut f32).add(i) = s };
        if s == 1.0 {
            first.push(i);
        }
    }
    Ok(first)
}

fn add_into<D: Elem, S: Elem>(dst: &mut [D], src: &[S]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::from_f32(d.to_f32() + s.to_f32());
    }
}

/// `dst += src`, element by element, computed in fp32 and rounded to `dst`'s dtype (as torch adds
/// a gradient into an existing one). Both are host tensors of the same length.
#[pyfunction]
#[pyo3(signature = (dst, src, *, num_threads=1))]
pub fn grad_accumulate(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    let pool = pool(num_threads)?;
    let d = Import::new(dst, "dst")?;
    let s = Import::new(src, "src")?;
    if d.len != s.len {
        return Err(PyValueError::new_err(format!(
            "src: has {} elements, dst {}",
            s.len, d.len
        )));
    }
    if !d.contiguous || !s.contiguous {
        return Err(PyValueError::new_err("dst and src must be contiguous"));
    }
    check_disjoint(vec![
        (d.range().0, d.range().1, "dst".into()),
        (s.range().0, s.range().1, "src".into()),
    ])?;
    let n = d.len;
    let (dp, sp, dd, sd) = (d.ptr() as usize, s.addr(), d.dtype, s.dtype);
    let run = move |lo: usize, hi: usize| {
        // SAFETY: both Imports outlive the call; [lo, hi) chunks are disjoint; dst and src do not
        // overlap (checked); lengths match.
        unsafe {
            macro_rules! go {
                ($D:ty, $S:ty) => {
                    add_into::<$D, $S>(
                        slice_mut::<$D>(dp as *mut u8, lo, hi - lo),
                        std::slice::from_raw_parts((sp as *const $S).add(lo), hi - lo),
                    )
                };
            }
            match (dd, sd) {
                (DType::F32, DType::F32) => go!(f32, f32),
                (DType::F32, DType::Bf16) => go!(f32, Bf16),
                (DType::F32, DType::F16) => go!(f32, F16),
                (DType::Bf16, DType::F32) => go!(Bf16, f32),
                (DType::Bf16, DType::Bf16) => go!(Bf16, Bf16),
                (DType::Bf16, DType::F16) => go!(Bf16, F16),
                (DType::F16, DType::F32) => go!(F16, f32),
                (DType::F16, DType::Bf16) => go!(F16, Bf16),
                (DType::F16, DType::F16) => go!(F16, F16),
            }
        }
    };
    let chunks: Vec<(usize, usize)> = (0..n)
        .step_by(kernel::CHUNK)
        .map(|lo| (lo, (lo + kernel::CHUNK).min(n)))
        .collect();
    let pool_ref = pool.as_deref();
    py.detach(move || match pool_ref {
        Some(p) => p.install(|| chunks.into_par_iter().for_each(|(lo, hi)| run(lo, hi))),
        None => chunks.into_iter().for_each(|(lo, hi)| run(lo, hi)),
    });
    Ok(())
}
