//! `StateSet`: the host state of one param group, whatever device its parameters live on, and
//! the step over any number of sets.
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

use super::convert::{err, hyper, pool, runtime_error, simd_or_default, type_error, value_error, HyperTuple};
use super::dlpack::{
    carve_sets, data_ptr, torch, Carved, CheckedGrad, DType, GradCache, GradSpec, Import, Ranges, Writable,
};
use crate::elem::Bf16;
use crate::kernel::{self, Consts, GradRef, HostMut, Hyper, OutMut, Segment, StateMut};
use crate::layout::{carve, check_disjoint, Layout, Slot, KINDS};

// Where each buffer sits in a set's `Writable`.
const EXP_AVG: usize = 0;
const EXP_AVG_SQ: usize = 1;
const MAX_EXP_AVG_SQ: usize = 2;
const MASTER: usize = 3;
const STEPS: usize = 4;
/// The Kahan compensation of bfloat16 weights kept without a float32 master.
const COMP: usize = 5;
/// The landing buffers of float32, bfloat16 and float16 gradients.
const LANDING: usize = 6;
/// One per parameter, when weights are written in place.
const PARAMS: usize = LANDING + KINDS;

const KIND_DTYPES: [DType; KINDS] = [DType::F32, DType::Bf16, DType::F16];

/// A parameter whose weights the kernel writes in place.
struct Param {
    param: Py<PyAny>,
    numel: usize,
    complex: bool,
    /// The dtype of its memory (float32 for complex64 parameters, seen as real pairs).
    dtype: DType,
    shape: Vec<i64>,
    /// Its strides when it is not row-major contiguous, to check a gradient against.
    strides: Option<Vec<i64>>,
    /// Address of the storage this set imported.
    data_ptr: usize,
}

struct Inner {
    layout: Layout,
    names: Vec<String>,
    bufs: Writable,
    /// Per slot, the parameter whose memory the kernel writes in place, or (None, or no list)
    /// the masters, with a low-precision slot's copy going over the gradient in its landing
    /// slot.
    params: Option<Vec<Option<Param>>>,
    /// Gradients read from the parameters' `.grad`, or (None) from the landing buffers.
    grads: Option<GradCache>,
    state_dtype: DType,
    /// Moments in uint8 buffers: per slot, its first byte in each moment buffer and its codec
    /// ([`MomentCodec`]).
    moments: Option<Vec<(usize, MomentCodec)>>,
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
    fn quantized(self) -> bool {
        self != MomentCodec::F32
    }
}

/// Bytes of a slot of `n` elements in a uint8 moment buffer.
fn moment_bytes(n: usize, codec: MomentCodec) -> usize {
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
    fn rebind_if_replaced(&mut self, py: Python<'_>, i: usize) -> PyResult<()> {
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
    fn lock(&self) -> PyResult<MutexGuard<'_, Inner>> {
        self.inner
            .try_lock()
            .map_err(|_| runtime_error("another step is running on this param group"))
    }
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
