//! Conversions between the core and Python: the one mapping of core errors to Python exceptions,
//! the SIMD path and thread pool a call asks for, and a param group's hyper-parameters.

use std::sync::Arc;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::Error;
use crate::isa::{self, Simd};
use crate::kernel::Hyper;

/// The Python exception of a core error.
pub fn err(e: Error) -> PyErr {
    match e {
        Error::Value(m) => PyValueError::new_err(m),
        Error::Type(m) => PyTypeError::new_err(m),
        Error::Runtime(m) => PyRuntimeError::new_err(m),
        Error::Io(errno, m) => PyOSError::new_err((errno, m)),
    }
}

/// A `ValueError`: the binding's own checks raise through the one mapping, as core errors do.
pub fn value_error(m: impl Into<String>) -> PyErr {
    err(Error::Value(m.into()))
}

/// A `TypeError` (see [`value_error`]).
pub fn type_error(m: impl Into<String>) -> PyErr {
    err(Error::Type(m.into()))
}

/// A `RuntimeError` (see [`value_error`]).
pub fn runtime_error(m: impl Into<String>) -> PyErr {
    err(Error::Runtime(m.into()))
}

/// The SIMD path named by a call, or the default one (`OFFLOAD_ADAM_SIMD`, else the best).
pub fn simd_or_default(simd: Option<&str>) -> PyResult<Simd> {
    match simd {
        None => isa::default_simd().map_err(|e| err(e.context("OFFLOAD_ADAM_SIMD"))),
        Some(s) => isa::resolve(s).map_err(|e| err(e.context("simd"))),
    }
}

/// The private pool of `num_threads` threads (None: run on the calling thread).
pub fn pool(num_threads: usize) -> PyResult<Option<Arc<rayon::ThreadPool>>> {
    crate::pool::get(num_threads).map_err(|e| err(e.context("num_threads")))
}

/// A param group's hyper-parameters as the Python layer normalised them:
/// `(lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize)`.
pub type HyperTuple = (f64, f64, f64, f64, f64, bool, bool, bool);

/// The kernel's hyper-parameters, checked; errors start with `what` (`param group 0`).
pub fn hyper(t: HyperTuple, what: &str, grad_scale: f64, bias_correction: bool) -> PyResult<Hyper> {
    let (lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize) = t;
    let h = Hyper {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        decoupled,
        amsgrad,
        maximize,
        bias_correction,
        grad_scale,
    };
    h.validate().map_err(|e| err(e.context(what)))?;
    Ok(h)
}
