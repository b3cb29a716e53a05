//! Importing torch tensors through DLPack, in place, and the one place where host memory becomes
//! Rust slices.
//!
//! Two kinds of memory reach the kernel:
//! - long-lived buffers (parameters, flat state buffers, landing buffers), imported once as an
//!   [`Import`] and grouped in a [`Writable`] set whose byte ranges are checked pairwise disjoint;
//!   [`carve_sets`] hands them out as mutable slices after checking that the sets of one step are
//!   disjoint from each other too;
//! - gradients read from `p.grad` every step (exporting thousands of them through DLPack would
//!   cost about 4 us each): checked through the tensor's own methods by [`GradCache`] and viewed
//!   read-only for as long as the caller holds the tensor.
//!
//! `__dlpack__(max_version=(1, 0))` gives a `dltensor_versioned` capsule (older producers: a
//! legacy `dltensor` one). We take ownership of the managed tensor by renaming the capsule to
//! `used_*` (the protocol's hand-over), keep it until [`Import`] is dropped, then call its deleter:
//! as long as an `Import` lives, the producer keeps the memory alive, whatever Python does with
//! its own references.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyDict, PyWeakrefMethods, PyWeakrefReference};

use super::convert::{runtime_error, type_error, value_error};
use crate::elem::{Bf16, F16};
use crate::kernel::{GradRef, HostMut};
use crate::layout::{check_disjoint, merge_disjoint};

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const K_DL_CPU: i32 = 1;
const K_DL_CUDA: i32 = 2;
const K_DL_CUDA_HOST: i32 = 3;
const FLAG_READ_ONLY: u64 = 1 << 0;
const FLAG_IS_COPIED: u64 = 1 << 1;

const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
const LEGACY: &CStr = c"dltensor";
const USED_LEGACY: &CStr = c"used_dltensor";

/// Element types of imported buffers: the kernel's floats, and bytes (checksums and transfers
/// of the I/O engine, which work on any buffer's bytes; the kernel refuses them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
    U8,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
            DType::U8 => "uint8",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }
    fn from_dl(d: DLDataType) -> Result<DType, String> {
        match (d.code, d.bits, d.lanes) {
            (2, 32, 1) => Ok(DType::F32),
            (4, 16, 1) => Ok(DType::Bf16),
            (2, 16, 1) => Ok(DType::F16),
            (1, 8, 1) => Ok(DType::U8),
            (code, bits, lanes) => {
                let kind = match code {
                    0 => "int",
                    1 => "uint",
                    2 => "float",
                    4 => "bfloat",
                    5 => "complex",
                    6 => "bool",
                    _ => "type code ",
                };
                Err(format!(
                    "{kind}{bits}{}",
                    if lanes > 1 { format!("x{lanes}") } else { String::new() }
                ))
            }
        }
    }
}

enum Managed {
    Versioned(*mut DLManagedTensorVersioned),
    Legacy(*mut DLManagedTensor),
}

/// A tensor imported through DLPack: its host memory, kept alive until drop.
pub struct Import {
    managed: Managed,
    ptr: *mut u8,
    /// Elements.
    pub len: usize,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
    /// Row-major contiguous (as opposed to dense in another order, like channels_last).
    pub contiguous: bool,
}

// SAFETY: an Import is a plain owned buffer: the pointer is to host memory that the producer keeps
// alive until our deleter call, and nothing in it is tied to a thread. The deleter runs in Drop,
// which happens with the GIL held (Imports live in pyclasses or on the stack of a call from
// Python), as torch's deleter may release a Python object.
unsafe impl Send for Import {}
// SAFETY: shared access only reads the metadata; the memory itself is reached only through
// `Writable::carve`, which takes the set mutably.
unsafe impl Sync for Import {}

impl Drop for Import {
    fn drop(&mut self) {
        // SAFETY: we own the managed tensor (the capsule was renamed to `used_*`), and call its
        // deleter exactly once, as the DLPack protocol asks of a consumer.
        unsafe {
            match self.managed {
                Managed::Versioned(m) => {
                    if let Some(d) = (*m).deleter {
                        d(m)
                    }
                }
                Managed::Legacy(m) => {
                    if let Some(d) = (*m).deleter {
                        d(m)
                    }
                }
            }
        }
    }
}

impl Import {
    /// [`Import::new`] of a tensor that must be row-major contiguous (a `ValueError` naming it
    /// otherwise).
    pub fn contiguous(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Import> {
        let imp = Import::new(obj, name)?;
        if !imp.contiguous {
            return Err(value_error(format!("{name}: must be contiguous")));
        }
        Ok(imp)
    }

    /// Imports `obj` (a tensor, or a DLPack capsule) as a host buffer; `name` is used in errors.
    pub fn new(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Import> {
        let py = obj.py();
        let capsule = if obj.is_instance_of::<PyCapsule>() {
            obj.clone()
        } else {
            if !obj.hasattr("__dlpack__")? {
                return Err(type_error(format!(
                    "{name}: expected a torch.Tensor (an object with __dlpack__), got {}",
                    obj.get_type().name()?
                )));
            }
            let kw = PyDict::new(py);
            kw.set_item("max_version", (1, 0))?;
            match obj.call_method("__dlpack__", (), Some(&kw)) {
                Ok(c) => c,
                // A producer that predates DLPack 1.0 does not know `max_version`.
                Err(e) if e.is_instance_of::<PyTypeError>(py) => obj
                    .call_method0("__dlpack__")
                    .map_err(|e| value_error(format!("{name}: DLPack export failed: {e}")))?,
                Err(e) => {
                    return Err(value_error(format!("{name}: DLPack export failed: {e}")));
                }
            }
        };
        let cap = capsule.as_ptr();
        // SAFETY: `cap` is a live object (we hold `capsule`); the PyCapsule calls check its type
        // and name before handing out the pointer, and we rename it before anything can fail, so
        // from here on we own the managed tensor (the capsule's destructor leaves `used_*` alone).
        let (managed, t, flags) = unsafe {
            if pyo3::ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
                let m = pyo3::ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
                if m.is_null() || pyo3::ffi::PyCapsule_SetName(cap, USED_VERSIONED.as_ptr()) != 0 {
                    return Err(PyErr::fetch(py));
                }
                (Managed::Versioned(m), &(*m).dl_tensor, (*m).flags)
            } else if pyo3::ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
                let m = pyo3::ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()) as *mut DLManagedTensor;
                if m.is_null() || pyo3::ffi::PyCapsule_SetName(cap, USED_LEGACY.as_ptr()) != 0 {
                    return Err(PyErr::fetch(py));
                }
                (Managed::Legacy(m), &(*m).dl_tensor, 0)
            } else {
                return Err(value_error(format!(
                    "{name}: not a usable DLPack capsule (already consumed, or not a dltensor)"
                )));
            }
        };
        // SAFETY: a valid DLTensor has `ndim` entries behind `shape` and (if not null) `strides`.
        let (shape, strides) = unsafe {
            let nd = t.ndim.max(0) as usize;
            let shape = if nd == 0 {
                vec![]
            } else {
                std::slice::from_raw_parts(t.shape, nd).to_vec()
            };
            let strides = if t.strides.is_null() || nd == 0 {
                None
            } else {
                Some(std::slice::from_raw_parts(t.strides, nd).to_vec())
            };
            (shape, strides)
        };
        let ptr = (t.data as *mut u8).wrapping_add(t.byte_offset as usize);
        let dl_dtype = t.dtype;
        let device = t.device;
        // From here, dropping `import` hands the tensor back through its deleter.
        let mut import = Import {
            managed,
            ptr,
            len: 0,
            dtype: DType::F32,
            shape,
            strides: vec![],
            contiguous: true,
        };
        import.dtype = DType::from_dl(dl_dtype).map_err(|got| {
            // (uint8 imports too, for checksums and transfers: the kernel's own checks refuse it)
            type_error(format!("{name}: dtype must be float32, bfloat16 or float16, got {got}"))
        })?;
        match device.device_type {
            K_DL_CPU | K_DL_CUDA_HOST => {}
            K_DL_CUDA => {
                return Err(value_error(format!(
                    "{name}: is on cuda:{}; the kernel needs it in host memory (CPU or pinned)",
                    device.device_id
                )))
            }
            other => {
                return Err(value_error(format!(
                    "{name}: is on DLPack device type {other}; the kernel needs host memory (CPU or pinned)"
                )))
            }
        }
        if flags & FLAG_READ_ONLY != 0 {
            return Err(value_error(format!("{name}: is read-only")));
        }
        if flags & FLAG_IS_COPIED != 0 {
            return Err(value_error(format!(
                "{name}: was copied on export; the kernel must work on the tensor's own memory"
            )));
        }
        let numel: i64 = import.shape.iter().product();
        import.len = numel.max(0) as usize;
        if import.len > 0 && t.data.is_null() {
            return Err(value_error(format!(
                "{name}: exports a null data pointer for {} elements (a DTensor or another tensor subclass \
                 without local memory); pass its local tensor",
                import.len
            )));
        }
        let contiguous_strides = contiguous_strides(&import.shape);
        import.strides = strides.unwrap_or_else(|| contiguous_strides.clone());
        import.contiguous = is_contiguous(&import.shape, &import.strides);
        if !is_dense(&import.shape, &import.strides) {
            return Err(value_error(format!(
                "{name}: must be dense in memory (contiguous, or a permutation of it), got shape {:?} strides {:?}",
                import.shape, import.strides
            )));
        }
        if import.len > 0 && !(import.ptr as usize).is_multiple_of(import.dtype.size()) {
            return Err(value_error(format!(
                "{name}: data pointer {:#x} is not aligned to its {}-byte elements",
                import.ptr as usize,
                import.dtype.size()
            )));
        }
        Ok(import)
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// Byte range `[start, end)` of the buffer.
    pub fn range(&self) -> (usize, usize) {
        (self.addr(), self.addr() + self.len * self.dtype.size())
    }

    /// The buffer's bytes, read-only (checksums of the NVMe tier's pages, which nobody writes
    /// while they are summed).
    pub fn bytes(&self) -> &[u8] {
        let (a, b) = self.range();
        if a == b {
            return &[];
        }
        // SAFETY: the producer keeps [a, b) alive while we hold the Import (until our deleter
        // call), `new` refused a null pointer with elements, and the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(a as *const u8, b - a) }
    }

    pub fn require(&self, dtype: DType, name: &str) -> PyResult<()> {
        if self.dtype != dtype {
            return Err(type_error(format!(
                "{name}: dtype must be {}, got {}",
                dtype.name(),
                self.dtype.name()
            )));
        }
        Ok(())
    }

    /// The whole buffer as mutable elements of its dtype.
    fn whole_mut(&mut self, _name: &str) -> PyResult<HostMut<'_>> {
        if self.len == 0 {
            return Ok(match self.dtype {
                DType::F32 => HostMut::F32(&mut []),
                DType::Bf16 => HostMut::Bf16(&mut []),
                DType::F16 => HostMut::F16(&mut []),
                DType::U8 => HostMut::U8(&mut []),
            });
        }
        // SAFETY: the producer keeps `len` elements of `dtype` alive at `ptr` until our deleter
        // runs (drop), the pointer is aligned to the element size (checked in `new`), and
        // `&mut self` makes this the only slice of this Import. No other Import handed out in
        // the same step shares a byte with it: `Writable` checks that within a set and
        // `carve_sets` across the sets of a step. (Python code writing the same tensors from
        // another thread during a step races, as it would with torch's own optimizer.)
        Ok(unsafe {
            match self.dtype {
                DType::F32 => HostMut::F32(std::slice::from_raw_parts_mut(self.ptr as *mut f32, self.len)),
                DType::Bf16 => HostMut::Bf16(std::slice::from_raw_parts_mut(self.ptr as *mut Bf16, self.len)),
                DType::F16 => HostMut::F16(std::slice::from_raw_parts_mut(self.ptr as *mut F16, self.len)),
                DType::U8 => HostMut::U8(std::slice::from_raw_parts_mut(self.ptr, self.len)),
            }
        })
    }
}

/// The imported buffers of one state set that a step may write, by index, with their byte
/// ranges kept sorted and pairwise disjoint.
pub struct Writable {
    imports: Vec<Option<Import>>,
    names: Vec<String>,
    ranges: Vec<(usize, usize)>,
}

impl Writable {
    /// Checks that no two of `imports` share a byte; the error names the two.
    pub fn new(imports: Vec<(Option<Import>, String)>) -> PyResult<Writable> {
        let (imports, names): (Vec<_>, Vec<_>) = imports.into_iter().unzip();
        let mut w = Writable {
            imports,
            names,
            ranges: Vec::new(),
        };
        w.recheck()?;
        Ok(w)
    }

    fn recheck(&mut self) -> PyResult<()> {
        let named = self
            .imports
            .iter()
            .zip(&self.names)
            .filter_map(|(i, n)| i.as_ref().map(|i| (i.range().0, i.range().1, n.clone())))
            .collect();
        self.ranges = check_disjoint(named).map_err(super::convert::err)?;
        Ok(())
    }

    /// Puts `import` at `index` (a buffer added later, or a parameter's new storage), checked
    /// against the others first: on error nothing changes.
    pub fn replace(&mut self, index: usize, import: Import, name: String) -> PyResult<()> {
        let (lo, hi) = import.range();
        let old = self.imports[index].as_ref().map(|i| i.range());
        let clash = self
            .imports
            .iter()
            .enumerate()
            .find(|(j, other)| *j != index && other.as_ref().is_some_and(|o| o.range().0 < hi && lo < o.range().1));
        if let (Some((j, _)), true) = (clash, hi > lo) {
            return Err(value_error(format!(
                "{name} and {} share memory; each parameter needs its own storage",
                self.names[j]
            )));
        }
        self.imports[index] = Some(import);
        self.names[index] = name;
        if old != Some((lo, hi)) {
            self.recheck()?;
        }
        Ok(())
    }

    pub fn get(&self, index: usize) -> Option<&Import> {
        self.imports.get(index).and_then(|i| i.as_ref())
    }

    pub fn name(&self, index: usize) -> &str {
        &self.names[index]
    }

    /// Sorted, disjoint byte ranges of the buffers.
    pub fn ranges(&self) -> &[(usize, usize)] {
        &self.ranges
    }
}

/// One set's buffers as mutable slices, by index.
pub type Carved<'a> = Vec<Option<HostMut<'a>>>;
/// Sorted, disjoint byte ranges `[lo, hi)`.
pub type Ranges = Vec<(usize, usize)>;

/// Every buffer of every set as mutable slices (`None` where a set has no buffer at an index),
/// after checking that no two sets share a byte. Gradients read in the same step must not overlap
/// any of the merged ranges returned: the caller checks each with `layout::overlaps`.
pub fn carve_sets<'a>(sets: Vec<&'a mut Writable>) -> PyResult<(Vec<Carved<'a>>, Ranges)> {
    let lists: Vec<&[(usize, usize)]> = sets.iter().map(|w| w.ranges.as_slice()).collect();
    let merged = merge_disjoint(&lists).map_err(super::convert::err)?;
    let mut out = Vec::with_capacity(sets.len());
    for w in sets {
        let names = &w.names;
        let mut bufs = Vec::with_capacity(w.imports.len());
        for (i, imp) in w.imports.iter_mut().enumerate() {
            bufs.push(imp.as_mut().map(|b| b.whole_mut(&names[i])).transpose()?);
        }
        out.push(bufs);
    }
    Ok((out, merged))
}

/// A tensor's `data_ptr()`. Read as an i64: CPython converts those with a plain digit loop, an
/// unsigned 64-bit one through a slower byte-array path (measurable at thousands per step).
pub fn data_ptr(t: &Bound<'_, PyAny>) -> PyResult<usize> {
    Ok(t.call_method0(intern!(t.py(), "data_ptr"))?.extract::<i64>()? as usize)
}

/// torch objects compared by identity on the hot path.
pub struct Torch {
    pub float32: Py<PyAny>,
    pub bfloat16: Py<PyAny>,
    pub float16: Py<PyAny>,
    pub complex64: Py<PyAny>,
    pub int8: Py<PyAny>,
    pub int64: Py<PyAny>,
    pub float8_e4m3fn: Py<PyAny>,
    pub strided: Py<PyAny>,
    pub view_as_real: Py<PyAny>,
    pub tensor: Py<PyAny>,
}

pub fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
    TORCH.get_or_try_init(py, || {
        let t = py.import("torch")?;
        Ok(Torch {
            float32: t.getattr("float32")?.unbind(),
            bfloat16: t.getattr("bfloat16")?.unbind(),
            float16: t.getattr("float16")?.unbind(),
            complex64: t.getattr("complex64")?.unbind(),
            int8: t.getattr("int8")?.unbind(),
            int64: t.getattr("int64")?.unbind(),
            float8_e4m3fn: t.getattr("float8_e4m3fn")?.unbind(),
            strided: t.getattr("strided")?.unbind(),
            view_as_real: t.getattr("view_as_real")?.unbind(),
            tensor: t.getattr("Tensor")?.unbind(),
        })
    })
}

/// What a gradient must look like to be read for a parameter.
pub struct GradSpec<'a> {
    pub name: &'a str,
    pub numel: usize,
    pub complex: bool,
    /// The parameter's strides when it is not row-major contiguous (channels_last, transposed).
    pub strides: Option<&'a [i64]>,
}

#[derive(Clone, Copy)]
struct GradInfo {
    ptr: usize,
    dtype: DType,
}

/// A gradient checked for a step: read-only elements, valid while the tensor is held.
pub struct CheckedGrad<'a, 'py> {
    _tensor: &'a Bound<'py, PyAny>,
    info: GradInfo,
    /// Elements the kernel reads.
    pub len: usize,
}

impl<'a> CheckedGrad<'a, '_> {
    /// Byte range `[start, end)`.
    pub fn range(&self) -> (usize, usize) {
        (self.info.ptr, self.info.ptr + self.len * self.info.dtype.size())
    }

    pub fn view(&self) -> GradRef<'a> {
        if self.len == 0 {
            return GradRef::F32(&[]);
        }
        // SAFETY: `info` was read from `_tensor` itself in this step (data_ptr, dtype, numel,
        // layout, device, alignment), and the borrow of `_tensor` keeps the tensor, hence its
        // storage, alive for 'a. The kernel only reads these elements; the caller checked that
        // they overlap no buffer the kernel writes. (Resizing the tensor from another thread
        // during the step races, as with torch's own optimizer.)
        unsafe {
            match self.info.dtype {
                DType::F32 => GradRef::F32(std::slice::from_raw_parts(self.info.ptr as *const f32, self.len)),
                DType::Bf16 => GradRef::Bf16(std::slice::from_raw_parts(self.info.ptr as *const Bf16, self.len)),
                DType::F16 => GradRef::F16(std::slice::from_raw_parts(self.info.ptr as *const F16, self.len)),
                DType::U8 => unreachable!("grad_info admits float gradients only"),
            }
        }
    }
}

/// Per parameter, a weak reference to the gradient checked last step and what was found: the
/// same gradient object at the same address needs no new checks (its dtype, layout and size
/// cannot change without its data pointer changing).
pub struct GradCache(Vec<Option<(Py<PyWeakrefReference>, GradInfo)>>);

impl GradCache {
    pub fn new(n: usize) -> GradCache {
        GradCache((0..n).map(|_| None).collect())
    }

    /// Checks `g`, the gradient of parameter `i`.
    pub fn check<'a, 'py>(
        &mut self,
        i: usize,
        g: &'a Bound<'py, PyAny>,
        spec: &GradSpec<'_>,
    ) -> PyResult<CheckedGrad<'a, 'py>> {
        let py = g.py();
        let len = if spec.complex { 2 * spec.numel } else { spec.numel };
        let cached = match &self.0[i] {
            Some((w, info)) if w.bind(py).upgrade().is_some_and(|o| o.is(g)) => {
                let now = data_ptr(g)?;
                (now == info.ptr).then_some(*info)
            }
            _ => None,
        };
        let info = match cached {
            Some(i) => i,
            None => {
                let info = grad_info(g, spec, torch(py)?)?;
                self.0[i] = PyWeakrefReference::new(g).ok().map(|w| (w.unbind(), info));
                info
            }
        };
        Ok(CheckedGrad { _tensor: g, info, len })
    }

    /// Forgets parameter `i`'s gradient (its parameter was re-bound).
    pub fn forget(&mut self, i: usize) {
        self.0[i] = None;
    }
}

fn grad_info(g: &Bound<'_, PyAny>, spec: &GradSpec<'_>, t: &Torch) -> PyResult<GradInfo> {
    let py = g.py();
    let name = spec.name;
    if !g.getattr(intern!(py, "layout"))?.is(&t.strided) {
        return Err(runtime_error(format!(
            "{name}: Adam does not support sparse gradients, please consider SparseAdam instead"
        )));
    }
    let dt = g.getattr(intern!(py, "dtype"))?;
    let dtype = if spec.complex {
        if !dt.is(&t.complex64) {
            return Err(type_error(format!(
                "{name}: gradient dtype must be complex64 like the parameter, got {dt}"
            )));
        }
        if g.call_method0(intern!(py, "is_conj"))?.is_truthy()? || g.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
            return Err(value_error(format!(
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
        return Err(type_error(format!(
            "{name}: gradient dtype must be float32, bfloat16 or float16, got {dt}"
        )));
    };
    if !g.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        let dev = g.getattr(intern!(py, "device"))?;
        return Err(value_error(format!(
            "{name}: gradient is on {dev}, the parameter on the CPU"
        )));
    }
    let numel: usize = g.call_method0(intern!(py, "numel"))?.extract()?;
    if numel != spec.numel {
        return Err(value_error(format!(
            "{name}: gradient has {numel} elements, the parameter {}",
            spec.numel
        )));
    }
    let same_layout = match spec.strides {
        None => g.call_method0(intern!(py, "is_contiguous"))?.is_truthy()?,
        Some(s) => g.call_method0(intern!(py, "stride"))?.extract::<Vec<i64>>()? == s,
    };
    if !same_layout && numel > 1 {
        return Err(value_error(format!(
            "{name}: gradient's memory layout differs from the parameter's (strides {}); make it match, e.g. p.grad = p.grad.contiguous()",
            g.call_method0(intern!(py, "stride"))?
        )));
    }
    let ptr = data_ptr(g)?;
    if numel > 0 && ptr == 0 {
        return Err(value_error(format!(
            "{name}: gradient has no local memory (null data pointer)"
        )));
    }
    if numel > 0 && !ptr.is_multiple_of(dtype.size()) {
        return Err(value_error(format!(
            "{name}: gradient data is not aligned to its elements"
        )));
    }
    Ok(GradInfo { ptr, dtype })
}

/// The elements of a [`HostView`], by dtype.
pub enum Elems<'a> {
    F32(&'a [f32]),
    Bf16(&'a [Bf16]),
    F16(&'a [F16]),
    I8(&'a [i8]),
    /// float8_e4m3fn bit patterns.
    F8E4M3(&'a [u8]),
    I64(&'a [i64]),
}

/// A contiguous CPU tensor checked through its own methods (dtype, layout, device, contiguity,
/// data pointer): no DLPack export, which costs microseconds per tensor and knows no float8. The
/// linear kernel's calls read three to five tensors, at decode dozens of calls per token.
/// `'a` borrows the tensor: its storage lives as long as the view.
pub struct HostView<'a, 'py> {
    _tensor: &'a Bound<'py, PyAny>,
    ptr: usize,
    dtype: ViewDType,
    pub shape: Vec<usize>,
    pub numel: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ViewDType {
    F32,
    Bf16,
    F16,
    I8,
    F8E4M3,
    I64,
}

impl ViewDType {
    fn size(self) -> usize {
        match self {
            ViewDType::F32 => 4,
            ViewDType::Bf16 | ViewDType::F16 => 2,
            ViewDType::I8 | ViewDType::F8E4M3 => 1,
            ViewDType::I64 => 8,
        }
    }
}

impl<'a, 'py> HostView<'a, 'py> {
    /// Checks `t` (a plain tensor or a Parameter: a wrapper subclass has no memory of its own);
    /// errors name it `name`.
    pub fn new(t: &'a Bound<'py, PyAny>, name: &str) -> PyResult<HostView<'a, 'py>> {
        let py = t.py();
        let tc = torch(py)?;
        if !t.is_instance(tc.tensor.bind(py))? {
            return Err(type_error(format!(
                "{name}: expected a torch.Tensor, got {}",
                t.get_type().name()?
            )));
        }
        let dt = t.getattr(intern!(py, "dtype"))?;
        let dtype = if dt.is(&tc.float32) {
            ViewDType::F32
        } else if dt.is(&tc.bfloat16) {
            ViewDType::Bf16
        } else if dt.is(&tc.float16) {
            ViewDType::F16
        } else if dt.is(&tc.int8) {
            ViewDType::I8
        } else if dt.is(&tc.float8_e4m3fn) {
            ViewDType::F8E4M3
        } else if dt.is(&tc.int64) {
            ViewDType::I64
        } else {
            return Err(type_error(format!("{name}: unsupported dtype {dt}")));
        };
        if !t.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            let dev = t.getattr(intern!(py, "device"))?;
            return Err(value_error(format!(
                "{name}: is on {dev}; the kernel needs it on the CPU"
            )));
        }
        if !t.getattr(intern!(py, "layout"))?.is(&tc.strided) {
            return Err(value_error(format!("{name}: must be a strided (dense) tensor")));
        }
        if !t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
            return Err(value_error(format!(
                "{name}: must be contiguous (strides {})",
                t.call_method0(intern!(py, "stride"))?
            )));
        }
        let shape: Vec<usize> = t.getattr(intern!(py, "shape"))?.extract()?;
        let numel = shape.iter().product();
        let ptr = if numel == 0 { 0 } else { data_ptr(t)? };
        if numel > 0 && (ptr == 0 || !ptr.is_multiple_of(dtype.size())) {
            return Err(value_error(format!(
                "{name}: data pointer {ptr:#x} is null or not aligned to its elements (a tensor subclass without memory of its own?)"
            )));
        }
        Ok(HostView {
            _tensor: t,
            ptr,
            dtype,
            shape,
            numel,
        })
    }

    /// Byte range `[start, end)`.
    pub fn range(&self) -> (usize, usize) {
        (self.ptr, self.ptr + self.numel * self.dtype.size())
    }

    /// The dtype's name, as torch spells it.
    pub fn dtype_name(&self) -> &'static str {
        match self.dtype {
            ViewDType::F32 => "float32",
            ViewDType::Bf16 => "bfloat16",
            ViewDType::F16 => "float16",
            ViewDType::I8 => "int8",
            ViewDType::F8E4M3 => "float8_e4m3fn",
            ViewDType::I64 => "int64",
        }
    }

    /// The elements, read-only.
    pub fn elems(&self) -> Elems<'a> {
        let n = self.numel;
        if n == 0 {
            return match self.dtype {
                ViewDType::F32 => Elems::F32(&[]),
                ViewDType::Bf16 => Elems::Bf16(&[]),
                ViewDType::F16 => Elems::F16(&[]),
                ViewDType::I8 => Elems::I8(&[]),
                ViewDType::F8E4M3 => Elems::F8E4M3(&[]),
                ViewDType::I64 => Elems::I64(&[]),
            };
        }
        let p = self.ptr;
        // SAFETY: `new` read dtype, shape, contiguity, device and a non-null aligned data pointer
        // from the tensor itself, whose borrow ('a) keeps its storage alive: `numel` elements of
        // the dtype at `p`. Read-only; writes by this call go only to a [`HostViewMut`] checked
        // disjoint from every view read (`HostViewMut::new`).
        unsafe {
            match self.dtype {
                ViewDType::F32 => Elems::F32(std::slice::from_raw_parts(p as *const f32, n)),
                ViewDType::Bf16 => Elems::Bf16(std::slice::from_raw_parts(p as *const Bf16, n)),
                ViewDType::F16 => Elems::F16(std::slice::from_raw_parts(p as *const F16, n)),
                ViewDType::I8 => Elems::I8(std::slice::from_raw_parts(p as *const i8, n)),
                ViewDType::F8E4M3 => Elems::F8E4M3(std::slice::from_raw_parts(p as *const u8, n)),
                ViewDType::I64 => Elems::I64(std::slice::from_raw_parts(p as *const i64, n)),
            }
        }
    }
}

/// The elements of a [`HostViewMut`], by dtype (the kernel's outputs).
pub enum ElemsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
}

/// A [`HostView`] written by a call: float32 or bfloat16, sharing no byte with the views the
/// call reads.
pub struct HostViewMut<'a, 'py>(HostView<'a, 'py>);

impl<'a, 'py> HostViewMut<'a, 'py> {
    /// `view`, checked disjoint from each of `reads` (`name` in the error).
    pub fn new(view: HostView<'a, 'py>, reads: &[&HostView<'_, '_>], name: &str) -> PyResult<HostViewMut<'a, 'py>> {
        let (lo, hi) = view.range();
        if reads.iter().any(|r| {
            let (a, b) = r.range();
            a < hi && lo < b
        }) {
            return Err(value_error(format!("{name}: shares memory with an input of the call")));
        }
        if !matches!(view.dtype, ViewDType::F32 | ViewDType::Bf16) {
            return Err(type_error(format!("{name}: dtype must be float32 or bfloat16")));
        }
        Ok(HostViewMut(view))
    }

    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }

    /// The elements, writable; `&mut self` makes this the only slice of the view.
    pub fn elems_mut(&mut self) -> ElemsMut<'_> {
        let (p, n) = (self.0.ptr, self.0.numel);
        if n == 0 {
            return match self.0.dtype {
                ViewDType::Bf16 => ElemsMut::Bf16(&mut []),
                _ => ElemsMut::F32(&mut []),
            };
        }
        // SAFETY: as for `HostView::elems`, and no view the call reads shares a byte with this
        // one (checked in `new`). (Python code touching the tensor from another thread during
        // the call races, as with torch's own ops.)
        unsafe {
            match self.0.dtype {
                ViewDType::Bf16 => ElemsMut::Bf16(std::slice::from_raw_parts_mut(p as *mut Bf16, n)),
                _ => ElemsMut::F32(std::slice::from_raw_parts_mut(p as *mut f32, n)),
            }
        }
    }
}

/// Row-major strides of `shape`.
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1].max(1);
    }
    s
}

/// Row-major contiguous, ignoring the strides of size-1 dimensions (as torch does).
pub fn is_contiguous(shape: &[i64], strides: &[i64]) -> bool {
    let mut expected = 1i64;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n == 0 {
            return true;
        }
        if n != 1 {
            if s != expected {
                return false;
            }
            expected *= n;
        }
    }
    true
}

/// Non-overlapping and dense: the elements fill exactly `numel` consecutive slots, in some order
/// of the dimensions (torch's `is_non_overlapping_and_dense`).
pub fn is_dense(shape: &[i64], strides: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut dims: Vec<(i64, i64)> = shape
        .iter()
        .zip(strides)
        .filter(|(n, _)| **n != 1)
        .map(|(&n, &s)| (s, n))
        .collect();
    dims.sort();
    let mut expected = 1i64;
    for (s, n) in dims {
        if s != expected {
            return false;
        }
        expected *= n;
    }
    true
}
