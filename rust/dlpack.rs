//! Importing torch tensors through DLPack, in place.
//!
//! `__dlpack__(max_version=(1, 0))` gives a `dltensor_versioned` capsule (older producers: a
//! legacy `dltensor` one). We take ownership of the managed tensor by renaming the capsule to
//! `used_*` (the protocol's hand-over), keep it until [`Import`] is dropped, then call its deleter:
//! as long as an `Import` lives, the producer keeps the memory alive, whatever Python does with
//! its own references.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

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

/// Element types the kernel works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
    fn from_dl(d: DLDataType) -> Result<DType, String> {
        match (d.code, d.bits, d.lanes) {
            (2, 32, 1) => Ok(DType::F32),
            (4, 16, 1) => Ok(DType::Bf16),
            (2, 16, 1) => Ok(DType::F16),
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
// SAFETY: shared access only reads the metadata; the memory itself is reached through `slice*`,
// whose callers serialize writers (see bindings.rs).
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
    /// Imports `obj` (a tensor, or a DLPack capsule) as a host buffer; `name` is used in errors.
    pub fn new(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Import> {
        let py = obj.py();
        let capsule = if obj.is_instance_of::<PyCapsule>() {
            obj.clone()
        } else {
            if !obj.hasattr("__dlpack__")? {
                return Err(PyTypeError::new_err(format!(
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
                    .map_err(|e| PyValueError::new_err(format!("{name}: DLPack export failed: {e}")))?,
                Err(e) => {
                    return Err(PyValueError::new_err(format!("{name}: DLPack export failed: {e}")));
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
                return Err(PyValueError::new_err(format!(
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
            PyTypeError::new_err(format!("{name}: dtype must be float32, bfloat16 or float16, got {got}"))
        })?;
        match device.device_type {
            K_DL_CPU | K_DL_CUDA_HOST => {}
            K_DL_CUDA => {
                return Err(PyValueError::new_err(format!(
                    "{name}: is on cuda:{}; the kernel needs it in host memory (CPU or pinned)",
                    device.device_id
                )))
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "{name}: is on DLPack device type {other}; the kernel needs host memory (CPU or pinned)"
                )))
            }
        }
        if flags & FLAG_READ_ONLY != 0 {
            return Err(PyValueError::new_err(format!("{name}: is read-only")));
        }
        if flags & FLAG_IS_COPIED != 0 {
            return Err(PyValueError::new_err(format!(
                "{name}: was copied on export; the kernel must work on the tensor's own memory"
            )));
        }
        let numel: i64 = import.shape.iter().product();
        import.len = numel.max(0) as usize;
        let contiguous_strides = contiguous_strides(&import.shape);
        import.strides = strides.unwrap_or_else(|| contiguous_strides.clone());
        import.contiguous = is_contiguous(&import.shape, &import.strides);
        if !is_dense(&import.shape, &import.strides) {
            return Err(PyValueError::new_err(format!(
                "{name}: must be dense in memory (contiguous, or a permutation of it), got shape {:?} strides {:?}",
                import.shape, import.strides
            )));
        }
        if import.len > 0 && !(import.ptr as usize).is_multiple_of(import.dtype.size()) {
            return Err(PyValueError::new_err(format!(
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

    pub fn require(&self, dtype: DType, name: &str) -> PyResult<()> {
        if self.dtype != dtype {
            return Err(PyTypeError::new_err(format!(
                "{name}: dtype must be {}, got {}",
                dtype.name(),
                self.dtype.name()
            )));
        }
        Ok(())
    }

    /// The raw element pointer, for the callers that build kernel slices (bindings.rs).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
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
