//! The fused Adam/AdamW update over flat slices, and the read-only gradient passes.
//!
//! [`reference`] is the specification: one element at a time, torch's order of operations
//! (`torch.optim.adam._single_tensor_adam`). The fast paths process blocks of
//! [`LANES`](crate::isa::LANES) lanes with FMA and multiply by `1/sqrt(bc2)` instead of dividing;
//! the tests bound their distance to the reference. A partial block at the end of a slice is
//! copied into a padded block and goes through the very same code, so every element's result
//! depends only on its own inputs: results are bitwise identical however the work is split
//! between threads.
//!
//! The rooms, each importing what it uses from the others by name (this file is only the face):
//! - `segment`: what one update is given (hyper-parameters, slices), validated;
//! - `float`: the block code of float moments and of Kahan weights, the prefetch of the next
//!   segment's streams;
//! - `q8`, `fp8` and `maps`: block-quantized moments (8-bit maps, fp8);
//! - `reference`: the specification;
//! - `path`: the code paths (one per SIMD choice, their features from `isa.rs`'s table) and
//!   `dispatch`, the one place a SIMD choice becomes a code path;
//! - `step`: the step (chunks, tasks, one match on the moments' codec per segment);
//! - `passes`: the gradient norm, the non-finite check, host accumulation;
//! - `tests`: every path against the specification.

pub mod fp8;
mod maps;
pub mod q8;

mod segment;
pub use segment::*;

/// The specification: one element at a time, in torch's order of operations, no FMA.
pub mod reference;

mod float;
pub use float::BlockIo;

mod path;

mod step;
pub use step::{adam_step, Pool, CHUNK};

mod passes;
pub use passes::{accumulate, grad_sq_norm, grads_nonfinite, HostMut};

#[cfg(test)]
mod tests;
