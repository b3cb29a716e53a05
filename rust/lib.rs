//! offload_adam: a fused, SIMD, multithreaded Adam/AdamW for PyTorch optimizer state kept in host
//! memory. See ARCHITECTURE.md for the rooms of the code.
//!
//! The core never touches Python: `elem` (element types), `isa` (run-time SIMD choice), `kernel`
//! (the update and the gradient reductions, one dispatch for all of them), `layout` (slots of
//! the flat buffers and the memory-disjointness checks), `pool` (fork-safe thread pools), `io`
//! (the NVMe tier's I/O engine), `window` (its RAM window) and `error`. The binding layer `py`
//! (feature `python`) imports torch tensors through DLPack and exposes the core to Python.

// NaN-aware checks are written `!(x >= 0.0)` on purpose; kernels take many buffers.
#![allow(clippy::neg_cmp_op_on_partial_ord, clippy::too_many_arguments)]

pub mod elem;
pub mod error;
pub mod io;
pub mod isa;
pub mod kernel;
pub mod layout;
pub mod linear;
pub mod omp;
pub mod pool;
pub mod window;

#[cfg(feature = "python")]
mod py;
