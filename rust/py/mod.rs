//! The Python module `offload_adam._native`: a thin layer over the core.
//!
//! `dlpack` imports torch tensors and is the one place where their memory becomes Rust slices;
//! `convert` maps core errors, SIMD names, thread counts and hyper-parameters; `state_set` is
//! the host state of a param group and the step; `functions` the module-level functions.

mod convert;
mod dlpack;
mod functions;
mod state_set;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<state_set::StateSet>()?;
    m.add_function(wrap_pyfunction!(state_set::adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(functions::adam_update, m)?)?;
    m.add_function(wrap_pyfunction!(functions::grad_accumulate, m)?)?;
    m.add_function(wrap_pyfunction!(functions::grad_sq_norm, m)?)?;
    m.add_function(wrap_pyfunction!(functions::grads_nonfinite, m)?)?;
    m.add_function(wrap_pyfunction!(functions::simd_path, m)?)?;
    m.add_function(wrap_pyfunction!(functions::simd_paths, m)?)?;
    m.add("CHUNK", crate::kernel::CHUNK)?;
    m.add("LANES", crate::isa::LANES)?;
    Ok(())
}
