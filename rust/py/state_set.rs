//! `StateSet`: the host state of one param group, whatever device its parameters live on: its
//! buffers and parameters imported and checked once, re-bound when a parameter's storage is
//! replaced. The step over any number of sets is `step.rs`.
//!
//! Every set has the same flat state buffers (moments, the amsgrad maximum, fp32 masters where
//! needed, step counts) and slot layout. Two choices tell the groups apart:
//! - where a step's gradients come from: the parameters' own `.grad` (CPU parameters), or host
//!   landing buffers that the Python layer fills (gradients streamed from a GPU);
//! - where updated weights go: in place into the parameters' memory (CPU parameters), or into
//!   the masters (and, for bf16/fp16 parameters, the landing slot the gradient came in), which
//!   the Python layer copies back to the device.

use std::sync::{Mutex, MutexGuard};

use pyo3::intern;
use pyo3::prelude::*;

use super::convert::{err, runtime_error, type_error, value_error};
use super::dlpack::{data_ptr, torch, DType, GradCache, Import, Writable};
use crate::kernel;
use crate::layout::{check_disjoint, Layout, Slot, KINDS};

// Where each buffer sits in a set's `Writable`.
pub(super) const EXP_AVG: usize = 0;
pub(super) const EXP_AVG_SQ: usize = 1;
pub(super) const MAX_EXP_AVG_SQ: usize = 2;
pub(super) const MASTER: usize = 3;
pub(super) const STEPS: usize = 4;
/// The Kahan compensation of bfloat16 weights kept without a float32 master.
pub(super) const COMP: usize = 5;
/// The landing buffers of float32, bfloat16 and float16 gradients.
pub(super) const LANDING: usize = 6;
/// One per parameter, when weights are written in place.
pub(super) const PARAMS: usize = LANDING + KINDS;

const KIND_DTYPES: [DType; KINDS] = [DType::F32, DType::Bf16, DType::F16];

/// A parameter whose weights the kernel writes in place.
pub(super) struct Param {
    pub(super) param: Py<PyAny>,
    pub(super) numel: usize,
    pub(super) complex: bool,
    /// The dtype of its memory (float32 for complex64 parameters, seen as real pairs).
    pub(super) dtype: DType,
    pub(super) shape: Vec<i64>,
    /// Its strides when it is not row-major contiguous, to check a gradient against.
    pub(super) strides: Option<Vec<i64>>,
    /// Address of the storage this set imported.
    pub(super) data_ptr: usize,
}

pub(super) struct Inner {
    pub(super) layout: Layout,
    pub(super) names: Vec<String>,
    pub(super) bufs: Writable,
    /// Per slot, the parameter whose memory the kernel writes in place, or (None, or no list)
    /// the masters, with a low-precision slot's copy going over the gradient in its landing
    /// slot.
    pub(super) params: Option<Vec<Option<Param>>>,
    /// Gradients read from the parameters' `.grad`, or (None) from the landing buffers.
    pub(super) grads: Option<GradCache>,
    pub(super) state_dtype: DType,
    /// Moments in uint8 buffers: per slot, its first byte in each moment buffer and its codec
    /// ([`MomentCodec`]).
    pub(super) moments: Option<Vec<(usize, MomentCodec)>>,
}

/// The host state of one param group (see the module documentation).
#[pyclass(module = "offload_adam._native", frozen)]
pub struct StateSet {
    /// Held while a step runs on the set: two steps at once on one set would race.
    inner: Mutex<Inner>,
    len: usize,
    in_place: bool,
    from_landing: bool,
}

/// Exports a parameter's own memory (its real view for a complex parameter).
fn export<'py>(p: &Bound<'py, PyAny>, complex: bool) -> PyResult<Bound<'py, PyAny>> {
    let py = p.py();
    let d = p.call_method0(intern!(py, "detach"))?;
    if complex {
        torch(py)?.view_as_real.bind(py).call1((d,))
    } else {
        Ok(d)
    }
}

/// Imports parameter `p` for in-place updates, checked to be its own memory.
fn import_param(p: &Bound<'_, PyAny>, name: &str) -> PyResult<(Param, Import)> {
    let py = p.py();
    let t = torch(py)?;
    let complex = p.getattr(intern!(py, "dtype"))?.is(&t.complex64);
    let numel: usize = p.call_method0(intern!(py, "numel"))?.extract()?;
    let imp = Import::new(&export(p, complex)?, name)?;
    if imp.dtype == DType::U8 {
        return Err(type_error(format!(
            "{name}: dtype must be float32, bfloat16 or float16, got uint8"
        )));
    }
    let expected = if complex { 2 * numel } else { numel };
    if imp.len != expected {
        return Err(value_error(format!(
            "{name}: export has {} elements, expected {expected}",
            imp.len
        )));
    }
    let data_ptr = data_ptr(p)?;
    if numel > 0 && data_ptr != imp.addr() {
        return Err(value_error(format!(
            "{name}: the export is not the parameter's own memory"
        )));
    }
    let strides = if imp.contiguous {
        None
    } else {
        Some(p.call_method0(intern!(py, "stride"))?.extract()?)
    };
    let shape: Vec<i64> = p.getattr(intern!(py, "shape"))?.extract()?;
    let param = Param {
        param: p.clone().unbind(),
        numel,
        complex,
        dtype: imp.dtype,
        shape,
        strides,
        data_ptr,
    };
    Ok((param, imp))
}

/// How a slot of a uint8 moment buffer holds its moment: float32 (`4 n` bytes), or block-quantized
/// (`n` codes, then `n / 256` float32 absmax or scale values) with the dynamic maps or in fp8.
/// Python passes 0, 1 and 2.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum MomentCodec {
    F32,
    Q8,
    Fp8,
}

impl<'py> FromPyObject<'_, 'py> for MomentCodec {
    type Error = PyErr;
    fn extract(ob: pyo3::Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        match ob.extract::<u8>()? {
            0 => Ok(MomentCodec::F32),
            1 => Ok(MomentCodec::Q8),
            2 => Ok(MomentCodec::Fp8),
            k => Err(value_error(format!(
                "moments: codec {k} is none of 0 (float32), 1 (8-bit maps), 2 (fp8)"
            ))),
        }
    }
}

impl MomentCodec {
    pub(super) fn quantized(self) -> bool {
        self != MomentCodec::F32
    }
}

/// Bytes of a slot of `n` elements in a uint8 moment buffer.
pub(super) fn moment_bytes(n: usize, codec: MomentCodec) -> usize {
    if codec.quantized() {
        n + 4 * (n / kernel::QBLOCK)
    } else {
        4 * n
    }
}

/// The uint8 moments' slots: quantized ones in whole blocks, each on a 4-byte boundary, inside
/// the buffers, none overlapping.
fn check_moments(m: &[(usize, MomentCodec)], lens: &[usize], names: &[String], total: usize) -> PyResult<()> {
    if m.len() != lens.len() {
        return Err(value_error("moments: one (offset, codec) per slot"));
    }
    let mut ranges = Vec::with_capacity(m.len());
    for (i, (&(off, q), &n)) in m.iter().zip(lens).enumerate() {
        let name = &names[i];
        if q.quantized() && !n.is_multiple_of(kernel::QBLOCK) {
            return Err(value_error(format!(
                "{name}: a quantized moment needs whole blocks of {} elements, it has {n}",
                kernel::QBLOCK
            )));
        }
        if off % 4 != 0 {
            return Err(value_error(format!(
                "{name}: moment offset {off} is not a multiple of 4 bytes"
            )));
        }
        let end = off.checked_add(moment_bytes(n, q)).filter(|&e| e <= total);
        let Some(end) = end else {
            return Err(value_error(format!(
                "{name}: its moments end past the {total}-byte buffers"
            )));
        };
        ranges.push((off, end, name.clone()));
    }
    check_disjoint(ranges).map_err(err)?;
    Ok(())
}

/// The name of the buffer at `at` in a set's [`Writable`], for errors.
fn buffer_name(at: usize) -> String {
    match at {
        EXP_AVG => "exp_avg buffer".into(),
        EXP_AVG_SQ => "exp_avg_sq buffer".into(),
        MAX_EXP_AVG_SQ => "max_exp_avg_sq buffer".into(),
        MASTER => "master buffer".into(),
        STEPS => "steps buffer".into(),
        COMP => "Kahan compensation buffer".into(),
        k if (LANDING..PARAMS).contains(&k) => format!("{} landing buffer", KIND_DTYPES[k - LANDING].name()),
        _ => unreachable!("parameters are named by their slot"),
    }
}

/// The dtype a buffer must have.
#[derive(Clone, Copy)]
enum Dtype {
    /// The moments' (exp_avg's).
    Moments,
    Is(DType),
}

/// The length a buffer must have.
#[derive(Clone, Copy)]
enum Len {
    Any,
    /// exp_avg's.
    Moments,
    /// One element per slot.
    Slots,
    /// The buffers `state_offsets` point into (the moments and masters, or with uint8 moments
    /// the masters).
    State,
}

/// The lengths [`Len`] stands for, in one set.
struct Lengths {
    moments: usize,
    slots: usize,
    state: usize,
}

/// One flat buffer of a set: its place in the set's [`Writable`], the tensor given for it, and
/// what it must be.
struct BufferSpec<'a, 'py> {
    at: usize,
    tensor: Option<&'a Bound<'py, PyAny>>,
    dtype: Dtype,
    len: Len,
}

impl<'a, 'py> BufferSpec<'a, 'py> {
    fn new(at: usize, tensor: Option<&'a Bound<'py, PyAny>>, dtype: Dtype, len: Len) -> Self {
        BufferSpec { at, tensor, dtype, len }
    }

    /// The tensor imported (None if none was given), its dtype checked.
    fn import(&self, moments: DType) -> PyResult<Option<Import>> {
        let Some(t) = self.tensor else { return Ok(None) };
        let name = buffer_name(self.at);
        let imp = Import::new(t, &name)?;
        imp.require(
            match self.dtype {
                Dtype::Moments => moments,
                Dtype::Is(d) => d,
            },
            &name,
        )?;
        Ok(Some(imp))
    }

    fn check_len(&self, imp: &Import, expected: &Lengths) -> PyResult<()> {
        let (want, what) = match self.len {
            Len::Any => return Ok(()),
            Len::Moments => (expected.moments, "exp_avg's"),
            Len::Slots => (expected.slots, "one per parameter"),
            Len::State => (expected.state, "the state buffers'"),
        };
        if imp.len != want {
            return Err(value_error(format!(
                "{}: has {} elements, expected {want} ({what})",
                buffer_name(self.at),
                imp.len
            )));
        }
        Ok(())
    }
}

/// The landing buffers (one per gradient kind, or none) and each slot's place in them, checked
/// to come together and to have one entry per kind and per slot.
#[allow(clippy::type_complexity)]
fn landing_of<'py>(
    landing: Option<Vec<Option<Bound<'py, PyAny>>>>,
    landing_slots: Option<Vec<(usize, usize)>>,
    n: usize,
) -> PyResult<(Vec<Option<Bound<'py, PyAny>>>, Vec<Option<(usize, usize)>>)> {
    match (landing, landing_slots) {
        (None, None) => Ok((vec![None; KINDS], vec![None; n])),
        (Some(bufs), Some(where_)) if bufs.len() == KINDS && where_.len() == n => {
            Ok((bufs, where_.into_iter().map(Some).collect()))
        }
        (Some(_), Some(_)) => Err(value_error(
            "landing: three buffers (float32, bfloat16, float16) and one slot per parameter",
        )),
        _ => Err(value_error("landing and landing_slots go together")),
    }
}

/// The parameters written in place (`params`: per slot, or None for a slot written into the
/// masters), imported and checked against their slots; with their imports, named, for the
/// set's [`Writable`]. Without `params`, weights go into the masters.
#[allow(clippy::type_complexity)]
fn import_params(
    params: Option<Vec<Option<Bound<'_, PyAny>>>>,
    names: &[String],
    lens: &[usize],
    from_landing: bool,
    has_master: bool,
    has_comp: bool,
) -> PyResult<(Option<Vec<Option<Param>>>, Vec<(Option<Import>, String)>)> {
    let n = lens.len();
    let Some(ps) = params else {
        if !has_master {
            return Err(value_error(
                "master buffer: needed when weights are not written in place",
            ));
        }
        if !from_landing && n > 0 {
            return Err(value_error(
                "gradients: from the parameters' .grad needs params; otherwise give landing buffers",
            ));
        }
        return Ok((None, Vec::new()));
    };
    if ps.len() != n {
        return Err(value_error("params: one per slot"));
    }
    let mut out = Vec::with_capacity(n);
    let mut imports = Vec::with_capacity(n);
    for (i, p) in ps.iter().enumerate() {
        let Some(p) = p else {
            if !from_landing || !has_master {
                return Err(value_error(format!(
                    "{}: a slot not written in place needs a landing slot and a master",
                    names[i]
                )));
            }
            out.push(None);
            imports.push((None, names[i].clone()));
            continue;
        };
        let (param, imp) = import_param(p, &names[i])?;
        if imp.len != lens[i] {
            return Err(value_error(format!(
                "{}: has {} elements, its slot {}",
                names[i], imp.len, lens[i]
            )));
        }
        if param.dtype != DType::F32 && !has_master && !(param.dtype == DType::Bf16 && has_comp) {
            return Err(value_error(format!(
                "{}: a {} parameter needs a float32 master slot",
                names[i],
                param.dtype.name()
            )));
        }
        out.push(Some(param));
        imports.push((Some(imp), names[i].clone()));
    }
    Ok((Some(out), imports))
}

impl Inner {
    /// Re-binds parameter `i` if its storage was replaced since it was imported (`p.data = t`,
    /// `module.to_empty()` with swapped parameters): the new storage is imported, the old one is
    /// let go without a write. A new shape or dtype is an error, raised before anything changes.
    pub(super) fn rebind_if_replaced(&mut self, py: Python<'_>, i: usize) -> PyResult<()> {
        let Some(Some(e)) = self.params.as_ref().map(|ps| &ps[i]) else {
            return Ok(());
        };
        let p = e.param.bind(py);
        let ptr = data_ptr(p)?;
        if ptr == e.data_ptr || e.numel == 0 {
            return Ok(());
        }
        let p = p.clone();
        let name = self.names[i].clone();
        let t = torch(py)?;
        let dtype = p.getattr(intern!(py, "dtype"))?;
        let shape: Vec<i64> = p.getattr(intern!(py, "shape"))?.extract()?;
        let device = p.getattr(intern!(py, "device"))?;
        let same_dtype = match e.dtype {
            DType::F32 if e.complex => dtype.is(&t.complex64),
            DType::F32 => dtype.is(&t.float32),
            DType::Bf16 => dtype.is(&t.bfloat16),
            DType::F16 => dtype.is(&t.float16),
            DType::U8 => false,
        };
        if !same_dtype || shape != e.shape || !p.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            return Err(runtime_error(format!(
                "{name}: the parameter's storage was replaced after the optimizer was built, and it is now \
                 {dtype} of shape {shape:?} on {device}, not {} of shape {:?} on the CPU; the optimizer's state \
                 fits the old one. Build the optimizer after model.to()/.double()/p.data = ...",
                if e.complex { "complex64" } else { e.dtype.name() },
                e.shape
            )));
        }
        let (param, imp) = import_param(&p, &name)?;
        self.bufs.replace(PARAMS + i, imp, name)?;
        if let Some(c) = &mut self.grads {
            c.forget(i);
        }
        self.params.as_mut().expect("in place")[i] = Some(param);
        Ok(())
    }
}

#[pymethods]
impl StateSet {
    /// Builds the set. Slot `i` has `lens[i]` elements at `state_offsets[i]` of the flat state
    /// buffers (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `master`) and element `i` of `steps`.
    ///
    /// With `params`, weights are written in place into the parameters' own memory (a
    /// bfloat16/float16 parameter keeps its fp32 master in `master`); without, into `master`.
    /// A `None` in `params` is a slot written into `master` (it needs a landing slot).
    /// With `landing` (three optional buffers: float32, bfloat16, float16 gradients) and
    /// `landing_slots` (per slot: which buffer, first element), gradients come from there;
    /// without, from the parameters' `.grad`. A bfloat16/float16 slot written into `master`
    /// gets its low-precision copy in its landing slot, over the gradient it came in.
    ///
    /// With `comp` (bfloat16, slots at `state_offsets`), bfloat16 parameters written in place
    /// keep no float32 master: their weights are updated with Kahan compensation in `comp`.
    ///
    /// Moments in uint8 buffers need `moments`: per slot, its first byte in each moment buffer
    /// and its codec: 1 block-quantized with the 8-bit maps or 2 in fp8 (`n` codes then `n / 256`
    /// float32 absmax or scale values), or 0 float32 (`4 n` bytes); `state_offsets` then place
    /// the slots in `master` only.
    #[new]
    #[pyo3(signature = (lens, state_offsets, names, exp_avg, exp_avg_sq, steps, master=None, max_exp_avg_sq=None,
        *, params=None, landing=None, landing_slots=None, moments=None, comp=None))]
    fn new(
        lens: Vec<usize>,
        state_offsets: Vec<usize>,
        names: Vec<String>,
        exp_avg: &Bound<'_, PyAny>,
        exp_avg_sq: &Bound<'_, PyAny>,
        steps: &Bound<'_, PyAny>,
        master: Option<&Bound<'_, PyAny>>,
        max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
        params: Option<Vec<Option<Bound<'_, PyAny>>>>,
        landing: Option<Vec<Option<Bound<'_, PyAny>>>>,
        landing_slots: Option<Vec<(usize, usize)>>,
        moments: Option<Vec<(usize, MomentCodec)>>,
        comp: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StateSet> {
        let n = lens.len();
        if state_offsets.len() != n || names.len() != n {
            return Err(value_error(
                "lens, state_offsets and names need one entry per parameter",
            ));
        }
        // exp_avg gives the moments' dtype and length, which the others are checked against.
        let first = Import::new(exp_avg, &buffer_name(EXP_AVG))?;
        let state_dtype = first.dtype;
        if !matches!(state_dtype, DType::F32 | DType::Bf16 | DType::U8) {
            return Err(type_error(
                "exp_avg buffer: state dtype must be float32, bfloat16 or uint8",
            ));
        }
        match (&moments, state_dtype) {
            (Some(m), DType::U8) => check_moments(m, &lens, &names, first.len)?,
            (None, DType::U8) => return Err(value_error("moments: uint8 moment buffers need their slots")),
            (Some(_), _) => return Err(value_error("moments: only for uint8 moment buffers")),
            (None, _) => {}
        }
        // Gradients from landing buffers (a set reads all its gradients from one source).
        let from_landing = landing.is_some();
        let (landing, slot_landing) = landing_of(landing, landing_slots, n)?;
        // Every other buffer by its spec: imported and its dtype checked, then (once the
        // length `state_offsets` point into is known) its length.
        let mut specs = vec![
            BufferSpec::new(EXP_AVG_SQ, Some(exp_avg_sq), Dtype::Moments, Len::Moments),
            BufferSpec::new(STEPS, Some(steps), Dtype::Is(DType::F32), Len::Slots),
            BufferSpec::new(
                MASTER,
                master,
                Dtype::Is(DType::F32),
                if moments.is_none() { Len::State } else { Len::Any },
            ),
            BufferSpec::new(COMP, comp, Dtype::Is(DType::Bf16), Len::State),
        ];
        for (k, b) in landing.iter().enumerate() {
            specs.push(BufferSpec::new(
                LANDING + k,
                b.as_ref(),
                Dtype::Is(KIND_DTYPES[k]),
                Len::Any,
            ));
        }
        let mut bufs: Vec<Option<Import>> = (0..PARAMS).map(|_| None).collect();
        for spec in &specs {
            bufs[spec.at] = spec.import(state_dtype)?;
        }
        // Where `state_offsets` point: the moments and masters, or (uint8 moments) the masters.
        let state_len = match (&moments, &bufs[MASTER], &bufs[COMP]) {
            (None, _, _) => first.len,
            (Some(_), Some(m), _) => m.len,
            (Some(_), None, Some(c)) => c.len,
            (Some(_), None, None) => usize::MAX,
        };
        let expected = Lengths {
            moments: first.len,
            slots: n,
            state: state_len,
        };
        for spec in &specs {
            if let Some(imp) = &bufs[spec.at] {
                spec.check_len(imp, &expected)?;
            }
        }
        let slots: Vec<Slot> = (0..n)
            .map(|i| Slot {
                state: state_offsets[i],
                len: lens[i],
                landing: slot_landing[i],
            })
            .collect();
        let landing_lens = [0, 1, 2].map(|k| bufs[LANDING + k].as_ref().map(|b| b.len));
        let layout = Layout::new(slots, state_len, landing_lens).map_err(err)?;
        bufs[EXP_AVG] = Some(first);
        // Weights in place.
        let has_master = bufs[MASTER].is_some();
        let (params, param_imports) =
            import_params(params, &names, &lens, from_landing, has_master, bufs[COMP].is_some())?;
        let mut entries: Vec<(Option<Import>, String)> = bufs
            .into_iter()
            .enumerate()
            .map(|(at, b)| (b, buffer_name(at)))
            .collect();
        entries.extend(param_imports);
        let in_place = params.is_some();
        let inner = Inner {
            layout,
            names,
            bufs: Writable::new(entries)?,
            grads: (!from_landing).then(|| GradCache::new(n)),
            params,
            state_dtype,
            moments,
        };
        let set = StateSet {
            inner: Mutex::new(inner),
            len: n,
            in_place,
            from_landing,
        };
        if let Some(x) = max_exp_avg_sq {
            set.set_max_exp_avg_sq(x)?;
        }
        Ok(set)
    }

    /// Points slot `i` of an in-place set at another tensor object, for when the owner of the
    /// memory replaces the object (FSDP2 swaps a DTensor's local tensor). Its memory is imported,
    /// and its shape and dtype checked, at the next step, as for a replaced storage.
    fn replace_param(&self, i: usize, p: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut inner = self.lock()?;
        let Some(params) = inner.params.as_mut() else {
            return Err(runtime_error(
                "replace_param: this set does not write parameters in place",
            ));
        };
        let Some(e) = params.get_mut(i) else {
            return Err(value_error(format!("replace_param: no slot {i}")));
        };
        let Some(e) = e.as_mut() else {
            return Err(runtime_error(format!(
                "replace_param: slot {i} is not written in place"
            )));
        };
        e.param = p.clone().unbind();
        e.data_ptr = usize::MAX; // never a real address: the next step re-imports it
        Ok(())
    }

    /// Gives the set its amsgrad buffer (same length and dtype as exp_avg).
    fn set_max_exp_avg_sq(&self, buf: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut inner = self.lock()?;
        let spec = BufferSpec::new(MAX_EXP_AVG_SQ, Some(buf), Dtype::Moments, Len::Moments);
        let x = spec.import(inner.state_dtype)?.expect("given");
        let expected = Lengths {
            moments: inner.bufs.get(EXP_AVG).map_or(0, |b| b.len),
            slots: self.len,
            state: usize::MAX,
        };
        spec.check_len(&x, &expected)?;
        inner.bufs.replace(MAX_EXP_AVG_SQ, x, buffer_name(MAX_EXP_AVG_SQ))
    }

    #[getter]
    fn has_max_exp_avg_sq(&self) -> PyResult<bool> {
        Ok(self.lock()?.bufs.get(MAX_EXP_AVG_SQ).is_some())
    }

    /// Whether updated weights are written into the parameters' memory.
    #[getter]
    fn in_place(&self) -> bool {
        self.in_place
    }

    /// Whether gradients come from the landing buffers.
    #[getter]
    fn grads_landed(&self) -> bool {
        self.from_landing
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Raises if a parameter of this set shares memory with one of `others`.
    fn check_disjoint(&self, others: Vec<PyRef<'_, StateSet>>) -> PyResult<()> {
        let mut named = Vec::new();
        for s in std::iter::once(self).chain(others.iter().map(|o| &**o)) {
            let inner = s.lock()?;
            for i in 0..s.len {
                if let Some(b) = inner.bufs.get(PARAMS + i) {
                    named.push((b.range().0, b.range().1, inner.bufs.name(PARAMS + i).to_string()));
                }
            }
        }
        check_disjoint(named).map(|_| ()).map_err(err)
    }
}

impl StateSet {
    pub(super) fn lock(&self) -> PyResult<MutexGuard<'_, Inner>> {
        self.inner
            .try_lock()
            .map_err(|_| runtime_error("another step is running on this param group"))
    }
}
