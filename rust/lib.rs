//! offload_adam: a fused, SIMD, multithreaded Adam/AdamW for PyTorch optimizer state kept in host
//! memory. Layers (see DESIGN.md): `elem`/`isa`/`kernel` are pure Rust over slices; `pool` holds
//! the fork-safe thread pools; `dlpack` and `bindings` (feature `python`) talk to torch.

// NaN-aware checks are written `!(x >= 0.0)` on purpose; kernels take many buffers.
#![allow(clippy::neg_cmp_op_on_partial_ord, clippy::too_many_arguments)]

pub mod elem;
pub mod isa;
pub mod kernel;
pub mod pool;

#[cfg(feature = "python")]
mod bindings;
#[cfg(feature = "python")]
mod dlpack;
#[cfg(feature = "python")]
mod hostset;
