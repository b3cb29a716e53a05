//! The Python module `offload_adam._native`.
//!
//! Long-lived buffers (parameters, flat moment/master/step buffers) are imported once through
//! DLPack into a [`ParamSet`], one per param group. Gradients change every step, and exporting
//! thousands of them through DLPack would cost about 4 us each, so each step reads them from
//! `p.grad` directly (data_ptr, dtype, layout, shape checks through the tensor's own methods, about
//! 0.1 us each) and holds a strong reference to every gradient for as long as the kernel runs.

use std::sync::Mutex;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyWeakrefMethods, PyWeakrefReference};

use crate::dlpack::{DType, Import};
use crate::elem::Bf16;
use crate::isa::{self, Simd};
use crate::kernel::{self, Consts, GradRef, Hyper, OutMut, Segment, StateMut};

/// torch objects compared by identity on the hot path.
struct Torch {
    float32: Py<PyAny>,
    bfloat16: Py<PyAny>,
    float16: Py<PyAny>,
    complex64: Py<PyAny>,
    strided: Py<PyAny>,
}

fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
    TORCH.get_or_try_init(py, || {
        let t = py.import("torch")?;
        Ok(Torch {
            float32: t.getattr("float32")?.unbind(),
            bfloat16: t.getattr("bfloat16")?.unbind(),
            float16: t.getattr("float16")?.unbind(),
            complex64: t.getattr("complex64")?.unbind(),
            strided: t.getattr("strided")?.unbind(),
        })
    })
}

pub(crate) fn simd_or_default(simd: Option<&str>) -> PyResult<Simd> {
    match simd {
        None => isa::default_simd().map_err(|e| PyValueError::new_err(format!("OFFLOAD_ADAM_SIMD: {e}"))),
        Some(s) => isa::resolve(s).map_err(|e| PyValueError::new_err(format!("simd: {e}"))),
    }
}

pub(crate) fn pool(num_threads: usize) -> PyResult<Option<std::sync::Arc<rayon::ThreadPool>>> {
    crate::pool::get(num_threads).map_err(|e| PyValueError::new_err(format!("num_threads: {e}")))
}

/// Sorted, pairwise disjoint byte ranges; errors name the two owners.
pub(crate) fn check_disjoint(mut ranges: Vec<(usize, usize, String)>) -> PyResult<Vec<(usize, usize)>> {
    ranges.retain(|r| r.1 > r.0);
    ranges.sort_by_key(|r| r.0);
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PyValueError::new_err(format!(
                "{} and {} share memory; each parameter needs its own storage",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(ranges.into_iter().map(|r| (r.0, r.1)).collect())
}

/// Whether `[lo, hi)` meets any of the sorted disjoint `ranges`.
pub(crate) fn overlaps(ranges: &[(usize, usize)], lo: usize, hi: usize) -> bool {
    let i = ranges.partition_point(|r| r.0 < hi);
    i > 0 && ranges[i - 1].1 > lo
}

struct Entry {
    param: Py<PyAny>,
    name: String,
    /// The parameter's memory (its real view for complex parameters): master weights for a
    /// float32 parameter, the low-precision copy otherwise.
    export: Import,
    /// Elements the kernel sees (twice the parameter's for complex).
    len: usize,
    numel: usize,
    complex: bool,
    offset: usize,
    data_ptr: usize,
    /// The parameter's strides, to check a gradient against when the parameter is not
    /// row-major contiguous (channels_last, transposed).
    strides: Option<Vec<i64>>,
}

/// A gradient checked by an earlier step: a weak reference to it, and what was found.
type CachedGrad = (Py<PyWeakrefReference>, GradInfo);

/// The parameters of one param group, with their flat state buffers.
#[pyclass(module = "offload_adam._native", frozen)]
pub struct ParamSet {
    entries: Vec<Entry>,
    exp_avg: Import,
    exp_avg_sq: Import,
    max_exp_avg_sq: Mutex<Option<Import>>,
    master: Option<Import>,
    steps: Import,
    /// Byte ranges the kernel writes, sorted (no gradient may overlap them).
    writable: Vec<(usize, usize)>,
    /// Held while a step runs: two concurrent steps on one set would race. It guards the
    /// gradient cache: per parameter, a weak reference to the gradient checked last step.
    busy: Mutex<Vec<Option<CachedGrad>>>,
}

impl ParamSet {
    fn state_len(&self) -> usize {
        self.exp_avg.len
    }
    fn state_dtype(&self) -> DType {
        self.exp_avg.dtype
    }
}

#[pymethods]
impl ParamSet {
    /// Builds the set. `exports[i]` is `params[i].detach()` (`torch.view_as_real` of it for a
    /// complex parameter); parameter `i` owns elements `[offsets[i], offsets[i] + n_i)` of the
    /// flat `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` and (low-precision parameters) `master`
    /// buffers, and element `i` of `steps`.
    #[new]
    #[pyo3(signature = (params, exports, offsets, names, exp_avg, exp_avg_sq, steps, master=None, max_exp_avg_sq=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        params: Vec<Bound<'_, PyAny>>,
        exports: Vec<Bound<'_, PyAny>>,
        offsets: Vec<usize>,
        names: Vec<String>,
        exp_avg: &Bound<'_, PyAny>,
        exp_avg_sq: &Bound<'_, PyAny>,
        steps: &Bound<'_, PyAny>,
        master: Option<&Bound<'_, PyAny>>,
        max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<ParamSet> {
        let n = params.len();
        if exports.len() != n || offsets.len() != n || names.len() != n {
            return Err(PyValueError::new_err(
                "params, exports, offsets and names must have one entry per parameter",
            ));
        }
        let t = torch(py)?;
        let exp_avg = Import::new(exp_avg, "exp_avg buffer")?;
        let exp_avg_sq = Import::new(exp_avg_sq, "exp_avg_sq buffer")?;
        if exp_avg.dtype == DType::F16 {
            return Err(PyTypeError::new_err(
                "exp_avg buffer: state dtype must be float32 or bfloat16",
            ));
        }
        exp_avg_sq.require(exp_avg.dtype, "exp_avg_sq buffer")?;
        if exp_avg_sq.len != exp_avg.len {
            return Err(PyValueError::new_err("exp_avg and exp_avg_sq buffers differ in length"));
        }
        let steps = Import::new(steps, "steps buffer")?;
        steps.require(DType::F32, "steps buffer")?;
        if steps.len != n {
            return Err(PyValueError::new_err(format!(
                "steps buffer: needs {n} elements, has {}",
                steps.len
            )));
        }
        let master = master.map(|m| Import::new(m, "master buffer")).transpose()?;
        if let Some(m) = &master {
            m.require(DType::F32, "master buffer")?;
        }
        let mut entries = Vec::with_capacity(n);
        let mut ranges = Vec::new();
        for (i, (p, e)) in params.iter().zip(&exports).enumerate() {
            let name = names[i].clone();
            let export = Import::new(e, &name)?;
            let numel: usize = p.call_method0(intern!(py, "numel"))?.extract()?;
            let dtype = p.getattr(intern!(py, "dtype"))?;
            let complex = dtype.is(&t.complex64);
            let expected = if complex { 2 * numel } else { numel };
            if export.len != expected {
                return Err(PyValueError::new_err(format!(
                    "{name}: export has {} elements, expected {expected}",
                    export.len
                )));
            }
            if complex && export.dtype != DType::F32 {
                return Err(PyTypeError::new_err(format!(
                    "{name}: complex parameters must be complex64"
                )));
            }
            let data_ptr: usize = p.call_method0(intern!(py, "data_ptr"))?.extract()?;
            if numel > 0 && data_ptr != export.addr() {
                return Err(PyValueError::new_err(format!(
                    "{name}: the export is not the parameter's own memory"
                )));
            }
            let end = offsets[i].checked_add(export.len).filter(|&e| e <= exp_avg.len);
            if end.is_none() {
                return Err(PyValueError::new_err(format!(
                    "{name}: state slot past the end of the flat buffers"
                )));
            }
            if export.dtype != DType::F32 {
                match &master {
                    Some(m) if offsets[i] + export.len <= m.len => {}
                    _ => {
                        return Err(PyValueError::new_err(format!(
                            "{name}: a {} parameter needs a float32 master slot",
                            export.dtype.name()
                        )))
                    }
                }
            }
            let strides = if export.contiguous {
                None
            } else {
                Some(p.call_method0(intern!(py, "stride"))?.extract()?)
            };
            ranges.push((export.range().0, export.range().1, name.clone()));
            entries.push(Entry {
                param: p.clone().unbind(),
                name,
                len: export.len,
                numel,
                complex,
                offset: offsets[i],
                data_ptr,
                strides,
                export,
            });
        }
        // State slots must not overlap either.
        let mut slots: Vec<(usize, usize, String)> = entries
            .iter()
            .map(|e| (e.offset, e.offset + e.len, e.name.clone()))
            .collect();
        slots.sort_by_key(|s| s.0);
        for w in slots.windows(2) {
            if w[1].0 < w[0].1 && w[0].1 > w[0].0 && w[1].1 > w[1].0 {
                return Err(PyValueError::new_err(format!(
                    "{} and {}: overlapping state slots",
                    w[0].2, w[1].2
                )));
            }
        }
        for (b, what) in [
            (Some(&exp_avg), "exp_avg buffer"),
            (Some(&exp_avg_sq), "exp_avg_sq buffer"),
            (Some(&steps), "steps buffer"),
            (master.as_ref(), "master buffer"),
        ] {
            if let Some(b) = b {
                ranges.push((b.range().0, b.range().1, what.to_string()));
            }
        }
        let writable = check_disjoint(ranges)?;
        let set = ParamSet {
            entries,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq: Mutex::new(None),
            master,
            steps,
            writable,
            busy: Mutex::new(Vec::new()),
        };
        if let Some(x) = max_exp_avg_sq {
            set.set_max_exp_avg_sq(x)?;
        }
        Ok(set)
    }

    /// Gives the set its amsgrad buffer (same length and dtype as exp_avg).
    fn set_max_exp_avg_sq(&self, buf: &Bound<'_, PyAny>) -> PyResult<()> {
        let x = import_max_exp_avg_sq(buf, self.state_dtype(), self.state_len(), &self.writable)?;
        install(&self.max_exp_avg_sq, &self.busy, x)
    }

    #[getter]
    fn has_max_exp_avg_sq(&self) -> bool {
        self.max_exp_avg_sq.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn __len__(&self) -> usize {
        self.entries.len()
    }

    /// Raises if a parameter of this set shares memory with one of `others`.
    fn check_disjoint(&self, others: Vec<PyRef<'_, ParamSet>>) -> PyResult<()> {
        let mut ranges: Vec<(usize, usize, String)> = self
            .entries
            .iter()
            .map(|e| (e.export.range().0, e.export.range().1, e.name.clone()))
            .collect();
        for o in &others {
            ranges.extend(
                o.entries
                    .iter()
                    .map(|e| (e.export.range().0, e.export.range().1, e.name.clone())),
            );
        }
        check_disjoint(ranges).map(|_| ())
    }
}

/// Imports the amsgrad buffer of a set whose moments are `len` elements of `dtype`, and whose
/// other buffers occupy the sorted byte ranges `writable`.
pub(crate) fn import_max_exp_avg_sq(
    buf: &Bound<'_, PyAny>,
    dtype: DType,
    len: usize,
    writable: &[(usize, usize)],
) -> PyResult<Import> {
    let x = Import::new(buf, "max_exp_avg_sq buffer")?;
    x.require(dtype, "max_exp_avg_sq buffer")?;
    if x.len != len {
        return Err(PyValueError::new_err(
            "max_exp_avg_sq buffer: length differs from exp_avg",
        ));
    }
    if overlaps(writable, x.range().0, x.range().1) {
        return Err(PyValueError::new_err(
            "max_exp_avg_sq buffer: shares memory with the other buffers",
        ));
    }
    Ok(x)
}

/// Puts an amsgrad buffer in its slot, unless a step is running on the set (`busy`).
pub(crate) fn install<T>(slot: &Mutex<Option<Import>>, busy: &Mutex<T>, x: Import) -> PyResult<()> {
    let _busy = busy
        .try_lock()
        .map_err(|_| PyRuntimeError::new_err("a step is running on this param group"))?;
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(x);
    Ok(())
}

/// The hyper-parameters of a torch param group.
pub(crate) fn hyper(group: &Bound<'_, PyDict>, gi: usize, grad_scale: f64, bias_correction: bool) -> PyResult<Hyper> {
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        group
            .get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("param group {gi}: missing key {k:?}")))
    };
    let f = |k: &str| -> PyResult<f64> {
        get(k)?
            .extract::<f64>()
            .map_err(|_| PyTypeError::new_err(format!("param group {gi}: {k} must be a float")))
    };
    let b = |k: &str| -> PyResult<bool> { get(k)?.is_truthy() };
    // Any pair, as torch takes it: a tuple, or a list from a JSON/YAML config or DCP's full
    // state dict; floats or 1-element tensors.
    let pair: Vec<Bound<'_, PyAny>> = get("betas")?
        .try_iter()
        .and_then(|it| it.collect())
        .map_err(|_| PyTypeError::new_err(format!("param group {gi}: betas must be a pair of floats")))?;
    let [beta1, beta2] = <[Bound<'_, PyAny>; 2]>::try_from(pair)
        .map_err(|_| PyTypeError::new_err(format!("param group {gi}: betas must be a pair of floats")))?
        .map(|b| b.extract::<f64>());
    let bad = |_| PyTypeError::new_err(format!("param group {gi}: betas must be a pair of floats"));
    let (beta1, beta2) = (beta1.map_err(bad)?, beta2.map_err(bad)?);
    let h = Hyper {
        lr: f("lr")?,
        beta1,
        beta2,
        eps: f("eps")?,
        weight_decay: f("weight_decay")?,
        decoupled: b("decoupled_weight_decay")?,
        amsgrad: b("amsgrad")?,
        maximize: b("maximize")?,
        bias_correction,
        grad_scale,
    };
    h.validate()
        .map_err(|e| PyValueError::new_err(format!("param group {gi}: {e}")))?;
    Ok(h)
}

/// What a step learned about one parameter's gradient.
#[derive(Clone, Copy)]
pub(crate) struct GradInfo {
    pub(crate) ptr: usize,
    pub(crate) dtype: DType,
}

/// Checks `g` (the gradient of entry `e`) and returns where its elements are.
fn grad_info(e: &Entry, g: &Bound<'_, PyAny>, t: &Torch) -> PyResult<GradInfo> {
    let py = g.py();
    let name = &e.name;
    if !g.getattr(intern!(py, "layout"))?.is(&t.strided) {
        return Err(PyRuntimeError::new_err(format!(
            "{name}: Adam does not support sparse gradients, please consider SparseAdam instead"
        )));
    }
    let dt = g.getattr(intern!(py, "dtype"))?;
    let dtype = if e.complex {
        if !dt.is(&t.complex64) {
            return Err(PyTypeError::new_err(format!(
                "{name}: gradient dtype must be complex64 like the parameter, got {dt}"
            )));
        }
        if g.call_method0(intern!(py, "is_conj"))?.is_truthy()? || g.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
            return Err(PyValueError::new_err(format!(
                "{name}: gradient has a lazy conj/neg bit; resolve it first"
            )));
        }
        DType::F32
    } else if dt.is(&t.float32) {
        DType::F32
    } else if dt.is(&t.bfloat16) {
        DType::Bf16
    } else if dt.is(&t.float16) {
        DType::F16
    } else {
        return Err(PyTypeError::new_err(format!(
            "{name}: gradient dtype must be float32, bfloat16 or float16, got {dt}"
        )));
    };
    if !g.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        let dev = g.getattr(intern!(py, "device"))?;
        return Err(PyValueError::new_err(format!(
            "{name}: gradient is on {dev}, the parameter on the CPU"
        )));
    }
    let numel: usize = g.call_method0(intern!(py, "numel"))?.extract()?;
    if numel != e.numel {
        return Err(PyValueError::new_err(format!(
            "{name}: gradient has {numel} elements, the parameter {}",
            e.numel
        )));
    }
    let same_layout = match &e.strides {
        None => g.call_method0(intern!(py, "is_contiguous"))?.is_truthy()?,
        Some(s) => g.call_method0(intern!(py, "stride"))?.extract::<Vec<i64>>()? == *s,
    };
    if !same_layout && numel > 1 {
        return Err(PyValueError::new_err(format!(
            "{name}: gradient's memory layout differs from the parameter's (strides {}); make it match, e.g. p.grad = p.grad.contiguous()",
            g.call_method0(intern!(py, "stride"))?
        )));
    }
    let ptr: usize = g.call_method0(intern!(py, "data_ptr"))?.extract()?;
    if numel > 0 && !ptr.is_multiple_of(dtype.size()) {
        return Err(PyValueError::new_err(format!(
            "{name}: gradient data is not aligned to its elements"
        )));
    }
    Ok(GradInfo { ptr, dtype })
}

/// # Safety
/// `ptr` (plus `off` elements) points to `len` live, aligned elements of `T` that nothing else
/// reads or writes for `'a`.
pub(crate) unsafe fn slice_mut<'a, T>(ptr: *mut u8, off: usize, len: usize) -> &'a mut [T] {
    if len == 0 {
        return &mut [];
    }
    unsafe { std::slice::from_raw_parts_mut((ptr as *mut T).add(off), len) }
}

/// # Safety
/// `ptr` points to `len` live, aligned elements of `T` that nobody writes for `'a`.
pub(crate) unsafe fn slice<'a, T>(ptr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
}

/// # Safety
/// As for [`slice_mut`], with the buffer's own dtype.
pub(crate) unsafe fn state_mut<'a>(b: &Import, off: usize, len: usize) -> StateMut<'a> {
    unsafe {
        match b.dtype {
            DType::Bf16 => StateMut::Bf16(slice_mut::<Bf16>(b.ptr(), off, len)),
            _ => StateMut::F32(slice_mut::<f32>(b.ptr(), off, len)),
        }
    }
}

/// # Safety
/// As for [`slice`].
pub(crate) unsafe fn grad_ref<'a>(g: &GradInfo, len: usize) -> GradRef<'a> {
    unsafe {
        match g.dtype {
            DType::F32 => GradRef::F32(slice(g.ptr, len)),
            DType::Bf16 => GradRef::Bf16(slice(g.ptr, len)),
            DType::F16 => GradRef::F16(slice(g.ptr, len)),
        }
    }
}

/// One optimizer step over `sets`, with the hyper-parameters of `groups` (torch param group
/// dicts, one per set). Parameters whose `.grad` is None are skipped and keep their step count.
/// Everything is checked before anything is written: on error, weights and state are as they were.
/// Returns, per set, the indices of the parameters stepped for the first time.
#[pyfunction]
#[pyo3(signature = (sets, groups, *, num_threads, grad_scale=1.0, bias_correction=true, simd=None))]
fn adam_step(
    py: Python<'_>,
    sets: Vec<PyRef<'_, ParamSet>>,
    groups: Vec<Bound<'_, PyDict>>,
    num_threads: usize,
    grad_scale: f64,
    bias_correction: bool,
    simd: Option<&str>,
) -> PyResult<Vec<Vec<usize>>> {
    if sets.len() != groups.len() {
        return Err(PyValueError::new_err("one param group per set"));
    }
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let t = torch(py)?;
    let mut caches: Vec<_> = sets
        .iter()
        .map(|s| {
            s.busy
                .try_lock()
                .map_err(|_| PyRuntimeError::new_err("another step is running on this optimizer"))
        })
        .collect::<PyResult<_>>()?;
    for (c, s) in caches.iter_mut().zip(&sets) {
        c.resize_with(s.entries.len(), || None);
    }
    let vmaxes: Vec<_> = sets
        .iter()
        .map(|s| s.max_exp_avg_sq.lock().unwrap_or_else(|e| e.into_inner()))
        .collect();

    // 1. Check everything, touch nothing.
    let mut hypers = Vec::with_capacity(sets.len());
    for (gi, (set, group)) in sets.iter().zip(&groups).enumerate() {
        let h = hyper(group, gi, grad_scale, bias_correction)?;
        if h.amsgrad && vmaxes[gi].is_none() {
            return Err(PyRuntimeError::new_err(format!(
                "param group {gi}: amsgrad needs a max_exp_avg_sq buffer"
            )));
        }
        let params = group
            .get_item("params")?
            .ok_or_else(|| PyValueError::new_err("param group without params"))?;
        if params.len()? != set.entries.len() {
            return Err(PyValueError::new_err(format!(
                "param group {gi}: has {} params, the optimizer was built with {}; use add_param_group to add parameters",
                params.len()?,
                set.entries.len()
            )));
        }
        hypers.push(h);
    }
    let mut keep_alive: Vec<Bound<'_, PyAny>> = Vec::new();
    let mut work: Vec<(usize, usize, GradInfo)> = Vec::new();
    for (si, set) in sets.iter().enumerate() {
        for (ei, e) in set.entries.iter().enumerate() {
            let p = e.param.bind(py);
            // The optimizer holds the old storage alive (DLPack), so a replaced storage
            // (`model.double()`, `p.data = ...`, `model.to(...)`) always has another address.
            let ptr: usize = p.call_method0(intern!(py, "data_ptr"))?.extract()?;
            if ptr != e.data_ptr && e.numel > 0 {
                let dtype = p.getattr(intern!(py, "dtype"))?;
                return Err(PyRuntimeError::new_err(format!(
                    "{}: the parameter's storage was replaced after the optimizer was built (now {dtype}); \
                     the optimizer's buffers still refer to the old one. Build the optimizer after model.to()/.double()/p.data = ...",
                    e.name
                )));
            }
            let g = p.getattr(intern!(py, "grad"))?;
            if g.is_none() {
                continue;
            }
            // The same gradient object as last step, at the same address, was checked then: its
            // dtype, layout and size cannot change without its data pointer changing.
            let cache = &mut caches[si][ei];
            let cached = match cache {
                Some((w, info)) if w.bind(py).upgrade().is_some_and(|o| o.is(&g)) => {
                    let now: usize = g.call_method0(intern!(py, "data_ptr"))?.extract()?;
                    (now == info.ptr).then_some(*info)
                }
                _ => None,
            };
            let info = match cached {
                Some(i) => i,
                None => {
                    let i = grad_info(e, &g, t)?;
                    *cache = PyWeakrefReference::new(&g).ok().map(|w| (w.unbind(), i));
                    i
                }
            };
            let (lo, hi) = (info.ptr, info.ptr + e.len * info.dtype.size());
            if e.len > 0 && sets.iter().any(|s| overlaps(&s.writable, lo, hi)) {
                return Err(PyValueError::new_err(format!(
                    "{}: gradient shares memory with a parameter or the optimizer's state",
                    e.name
                )));
            }
            keep_alive.push(g);
            work.push((si, ei, info));
        }
    }

    // 2. Build the kernel's view of the buffers.
    let mut new_steps = Vec::with_capacity(work.len());
    let mut segments = Vec::with_capacity(work.len());
    // Parameters of a group usually share their step count: compute its scalars once.
    let mut last: Option<(usize, u64, Consts)> = None;
    for (si, ei, info) in &work {
        let set = &sets[*si];
        let e = &set.entries[*ei];
        // SAFETY: `steps` holds one f32 per entry (checked at construction).
        let step = unsafe { *(set.steps.ptr() as *const f32).add(*ei) };
        let next = step as u64 + 1;
        new_steps.push(next as f32);
        let h = &hypers[*si];
        // SAFETY of the slices: every buffer is an Import owned by `set` (alive for this call) or
        // a gradient held in `keep_alive`; lengths and alignment were checked; parameter memory,
        // state slots and flat buffers are pairwise disjoint (construction), gradients overlap
        // none of them (above); `busy` keeps other steps on this set out. Another Python thread
        // writing these tensors while the step runs is a race, as it would be with torch's own
        // optimizer.
        let seg = unsafe {
            let (param, out) = match e.export.dtype {
                DType::F32 => (slice_mut::<f32>(e.export.ptr(), 0, e.len), OutMut::None),
                lowp => {
                    let m = set.master.as_ref().expect("checked at construction");
                    let master = slice_mut::<f32>(m.ptr(), e.offset, e.len);
                    let out = if lowp == DType::Bf16 {
                        OutMut::Bf16(slice_mut(e.export.ptr(), 0, e.len))
                    } else {
                        OutMut::F16(slice_mut(e.export.ptr(), 0, e.len))
                    };
                    (master, out)
                }
            };
            Segment {
                consts: match last {
                    Some((s, n, c)) if s == *si && n == next => c,
                    _ => {
                        let c = Consts::new(h, next);
                        last = Some((*si, next, c));
                        c
                    }
                },
                amsgrad: h.amsgrad,
                param,
                grad: grad_ref(info, e.len),
                exp_avg: state_mut(&set.exp_avg, e.offset, e.len),
                exp_avg_sq: state_mut(&set.exp_avg_sq, e.offset, e.len),
                max_exp_avg_sq: if h.amsgrad {
                    vmaxes[*si].as_ref().map(|x| state_mut(x, e.offset, e.len))
                } else {
                    None
                },
                out,
            }
        };
        segments.push(seg);
    }

    // 3. Run with the GIL released; only a validation error can come back, before any write.
    let pool_ref = pool.as_deref();
    py.detach(move || kernel::adam_step(simd, pool_ref, segments))
        .map_err(PyRuntimeError::new_err)?;

    let mut first = vec![Vec::new(); sets.len()];
    for ((si, ei, _), s) in work.iter().zip(new_steps) {
        // SAFETY: as above; the kernel is done, we hold `busy`.
        unsafe { *(sets[*si].steps.ptr() as *mut f32).add(*ei) = s };
        if s == 1.0 {
            first[*si].push(*ei);
        }
    }
    drop(keep_alive);
    Ok(first)
}

/// Imports a list of tensors as read-only gradients.
fn import_grads(tensors: &Bound<'_, PyAny>) -> PyResult<Vec<Import>> {
    tensors
        .try_iter()?
        .enumerate()
        .map(|(i, t)| Import::new(&t?, &format!("tensors[{i}]")))
        .collect()
}

fn grad_refs(imports: &[Import]) -> Vec<GradRef<'_>> {
    // SAFETY: each Import keeps its memory alive and is borrowed for the returned lifetime; the
    // reductions only read.
    imports
        .iter()
        .map(|b| unsafe {
            grad_ref(
                &GradInfo {
                    ptr: b.addr(),
                    dtype: b.dtype,
                },
                b.len,
            )
        })
        .collect()
}

/// Sum of squares of every element of `tensors` (float32/bfloat16/float16, host memory),
/// accumulated in float64; deterministic for any number of threads.
#[pyfunction]
#[pyo3(signature = (tensors, *, num_threads=1, simd=None))]
fn grad_sq_norm(py: Python<'_>, tensors: &Bound<'_, PyAny>, num_threads: usize, simd: Option<&str>) -> PyResult<f64> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let imports = import_grads(tensors)?;
    let refs = grad_refs(&imports);
    let pool_ref = pool.as_deref();
    py.detach(move || kernel::grad_sq_norm(simd, pool_ref, &refs))
        .map_err(PyRuntimeError::new_err)
}

/// Whether any element of `tensors` is an infinity or a NaN. Reads only.
#[pyfunction]
#[pyo3(signature = (tensors, *, num_threads=1, simd=None))]
fn grads_nonfinite(
    py: Python<'_>,
    tensors: &Bound<'_, PyAny>,
    num_threads: usize,
    simd: Option<&str>,
) -> PyResult<bool> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    let imports = import_grads(tensors)?;
    let refs = grad_refs(&imports);
    let pool_ref = pool.as_deref();
    py.detach(move || kernel::grads_nonfinite(simd, pool_ref, &refs))
        .map_err(PyRuntimeError::new_err)
}

/// One fused update of flat host tensors, in place: the kernel without the optimizer around it
/// (tests and benchmarks). `step` is the step count after this update (>= 1).
#[pyfunction]
#[pyo3(signature = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, out=None, *, step, lr=1e-3,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=true, amsgrad=false, maximize=false,
    bias_correction=true, grad_scale=1.0, num_threads=1, simd=None))]
#[allow(clippy::too_many_arguments)]
fn adam_update(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    exp_avg: &Bound<'_, PyAny>,
    exp_avg_sq: &Bound<'_, PyAny>,
    max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
    out: Option<&Bound<'_, PyAny>>,
    step: u64,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    bias_correction: bool,
    grad_scale: f64,
    num_threads: usize,
    simd: Option<&str>,
) -> PyResult<()> {
    let simd = simd_or_default(simd)?;
    let pool = pool(num_threads)?;
    if step == 0 {
        return Err(PyValueError::new_err(
            "step: must be >= 1 (the count after this update)",
        ));
    }
    let h = Hyper {
        lr,
        beta1: betas.0,
        beta2: betas.1,
        eps,
        weight_decay,
        decoupled,
        amsgrad,
        maximize,
        bias_correction,
        grad_scale,
    };
    h.validate().map_err(PyValueError::new_err)?;
    let p = Import::new(param, "param")?;
    p.require(DType::F32, "param")?;
    let g = Import::new(grad, "grad")?;
    let m = Import::new(exp_avg, "exp_avg")?;
    let v = Import::new(exp_avg_sq, "exp_avg_sq")?;
    let x = max_exp_avg_sq.map(|x| Import::new(x, "max_exp_avg_sq")).transpose()?;
    let o = out.map(|o| Import::new(o, "out")).transpose()?;
    if amsgrad && x.is_none() {
        return Err(PyValueError::new_err("max_exp_avg_sq: required with amsgrad=True"));
    }
    let mut named = vec![(&p, "param"), (&m, "exp_avg"), (&v, "exp_avg_sq")];
    if let Some(x) = &x {
        named.push((x, "max_exp_avg_sq"));
    }
    if let Some(o) = &o {
        if o.dtype == DType::F32 {
            return Err(PyTypeError::new_err("out: dtype must be bfloat16 or float16"));
        }
        named.push((o, "out"));
    }
    for (b, what) in named.iter().chain([(&g, "grad")].iter()) {
        if b.len != p.len {
            return Err(PyValueError::new_err(format!(
                "{what}: has {} elements, param {}",
                b.len, p.len
            )));
        }
        if !b.contiguous {
            return Err(PyValueError::new_err(format!("{what}: must be contiguous")));
        }
    }
    for (b, what) in &named[1..] {
        if (b.dtype == DType::F16) && !what.starts_with("out") {
            return Err(PyTypeError::new_err(format!(
                "{what}: state dtype must be float32 or bfloat16"
            )));
        }
    }
    let writable = check_disjoint(
        named
            .iter()
            .map(|(b, w)| (b.range().0, b.range().1, w.to_string()))
            .collect(),
    )?;
    if overlaps(&writable, g.range().0, g.range().1) {
        return Err(PyValueError::new_err(
            "grad: shares memory with a buffer the kernel writes",
        ));
    }
    let n = p.len;
    // SAFETY: the Imports live until the end of this function, lengths match, the written buffers
    // are pairwise disjoint and the gradient overlaps none of them.
    let seg = unsafe {
        Segment {
            consts: Consts::new(&h, step),
            amsgrad,
            param: slice_mut(p.ptr(), 0, n),
            grad: grad_ref(
                &GradInfo {
                    ptr: g.addr(),
                    dtype: g.dtype,
                },
                n,
            ),
            exp_avg: state_mut(&m, 0, n),
            exp_avg_sq: state_mut(&v, 0, n),
            max_exp_avg_sq: x.as_ref().map(|x| state_mut(x, 0, n)),
            out: match &o {
                None => OutMut::None,
                Some(o) if o.dtype == DType::Bf16 => OutMut::Bf16(slice_mut(o.ptr(), 0, n)),
                Some(o) => OutMut::F16(slice_mut(o.ptr(), 0, n)),
            },
        }
    };
    let pool_ref = pool.as_deref();
    py.detach(move || kernel::adam_step(simd, pool_ref, vec![seg]))
        .map_err(PyValueError::new_err)
}

/// The SIMD path used when none is named (`OFFLOAD_ADAM_SIMD`, else the best this CPU has).
#[pyfunction]
fn simd_path() -> PyResult<&'static str> {
    Ok(simd_or_default(None)?.name())
}

/// The SIMD paths this CPU can run, best last.
#[pyfunction]
fn simd_paths() -> Vec<&'static str> {
    Simd::available().into_iter().map(|s| s.name()).collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ParamSet>()?;
    m.add_class::<crate::hostset::HostSet>()?;
    m.add_function(wrap_pyfunction!(crate::hostset::host_step, m)?)?;
    m.add_function(wrap_pyfunction!(crate::hostset::grad_accumulate, m)?)?;
    m.add_function(wrap_pyfunction!(adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(adam_update, m)?)?;
    m.add_function(wrap_pyfunction!(grad_sq_norm, m)?)?;
    m.add_function(wrap_pyfunction!(grads_nonfinite, m)?)?;
    m.add_function(wrap_pyfunction!(simd_path, m)?)?;
    m.add_function(wrap_pyfunction!(simd_paths, m)?)?;
    m.add("CHUNK", kernel::CHUNK)?;
    m.add("LANES", isa::LANES)?;
    Ok(())
}
