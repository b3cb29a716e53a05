//! The Python module `offload_adam._native`: a thin layer over the core.
//!
//! `dlpack` imports torch tensors and is the one place where their memory becomes Rust slices;
//! `convert` maps core errors, SIMD names, thread counts and hyper-parameters; `state_set` is
//! the host state of a param group and `step` the step over any number of them (as `kernel/`
//! has its segments and its step); `functions` the module-level functions; `io` the NVMe tier's
//! I/O engine; `linear` the matmul of a few rows against stored weights; `experts` the routed experts of a
//! mixture-of-experts layer in one call.

mod convert;
mod dlpack;
mod experts;
mod functions;
mod io;
mod linear;
mod state_set;
mod step;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<state_set::StateSet>()?;
    m.add_function(wrap_pyfunction!(step::adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(functions::adam_update, m)?)?;
    m.add_function(wrap_pyfunction!(functions::grad_accumulate, m)?)?;
    m.add_function(wrap_pyfunction!(functions::grad_sq_norm, m)?)?;
    m.add_function(wrap_pyfunction!(functions::grads_nonfinite, m)?)?;
    m.add_function(wrap_pyfunction!(functions::simd_path, m)?)?;
    m.add_function(wrap_pyfunction!(functions::quantize, m)?)?;
    m.add_function(wrap_pyfunction!(functions::dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(functions::qmap, m)?)?;
    m.add_function(wrap_pyfunction!(functions::simd_paths, m)?)?;
    m.add_function(wrap_pyfunction!(linear::linear, m)?)?;
    m.add_function(wrap_pyfunction!(experts::experts, m)?)?;
    m.add_class::<io::IoEngine>()?;
    m.add_class::<io::IoTicket>()?;
    m.add_function(wrap_pyfunction!(io::crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(io::io_backend, m)?)?;
    m.add_class::<io::MemoryWindow>()?;
    m.add("CHUNK", crate::kernel::CHUNK)?;
    m.add("LANES", crate::isa::LANES)?;
    m.add("QBLOCK", crate::kernel::QBLOCK)?;
    m.add("Q8_MIN_NUMEL", crate::kernel::q8::MIN_NUMEL)?;
    Ok(())
}
