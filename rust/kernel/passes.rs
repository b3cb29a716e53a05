//! The read-only gradient passes (squared norm, non-finite check) and host-side gradient
//! accumulation.

use super::float::BlockIo;
use super::path::{dispatch, Path, Visit};
use super::segment::GradRef;
use super::step::{for_each, map, Pool, CHUNK};
use crate::elem::{Bf16, Elem, F16};
use crate::error::{Error, Result};
use crate::isa::Simd;

/// Gradients cut into chunks of at most [`CHUNK`] elements (`InOut` has none to read).
fn grad_chunks<'a>(grads: &[GradRef<'a>]) -> Vec<GradRef<'a>> {
    let mut out = Vec::new();
    for g in grads {
        let mut rest = match g {
            GradRef::F32(s) => GradRef::F32(s),
            GradRef::Bf16(s) => GradRef::Bf16(s),
            GradRef::F16(s) => GradRef::F16(s),
            GradRef::InOut => continue,
        };
        while rest.len() > CHUNK {
            let (a, b) = rest.split_at(CHUNK);
            out.push(a);
            rest = b;
        }
        if !rest.is_empty() {
            out.push(rest);
        }
    }
    out
}

/// A read-only pass over gradient chunks, one result per chunk.
trait ChunkPass: Send + Sync {
    type Out: Send;
    /// # Safety
    /// The CPU supports `P`.
    unsafe fn on<P: Path, G: BlockIo>(g: &[G]) -> Self::Out;
}

/// Runs pass `F` over the chunks of `grads` on whichever path [`dispatch`] picks.
fn chunk_pass<F: ChunkPass>(simd: Simd, pool: Pool<'_>, grads: &[GradRef<'_>]) -> Result<Vec<F::Out>> {
    struct Run<'p, 'a, F>(Pool<'p>, Vec<GradRef<'a>>, std::marker::PhantomData<F>);
    impl<F: ChunkPass> Visit for Run<'_, '_, F> {
        type Out = Vec<F::Out>;
        unsafe fn visit<P: Path>(self) -> Vec<F::Out> {
            map(self.0, &self.1, |g| {
                // SAFETY: the CPU supports `P` (this visit's contract); `grad_chunks` left out
                // `InOut`, which has nothing to read.
                unsafe {
                    match g {
                        GradRef::F32(s) => F::on::<P, _>(s),
                        GradRef::Bf16(s) => F::on::<P, _>(s),
                        GradRef::F16(s) => F::on::<P, _>(s),
                        GradRef::InOut => unreachable!("not chunked"),
                    }
                }
            })
        }
    }
    dispatch(simd, Run::<F>(pool, grad_chunks(grads), std::marker::PhantomData))
}

/// Sum of the squares of every gradient element, accumulated in f64. Deterministic: partial sums
/// of fixed chunks, added in order, whatever the number of threads.
pub fn grad_sq_norm(simd: Simd, pool: Pool<'_>, grads: &[GradRef<'_>]) -> Result<f64> {
    struct SqNorm;
    impl ChunkPass for SqNorm {
        type Out = f64;
        unsafe fn on<P: Path, G: BlockIo>(g: &[G]) -> f64 {
            // SAFETY: the caller's contract.
            unsafe { P::sq_norm(g) }
        }
    }
    Ok(chunk_pass::<SqNorm>(simd, pool, grads)?.iter().sum())
}

/// Whether any gradient element is an infinity or a NaN. Reads only.
pub fn grads_nonfinite(simd: Simd, pool: Pool<'_>, grads: &[GradRef<'_>]) -> Result<bool> {
    struct NonFinite;
    impl ChunkPass for NonFinite {
        type Out = bool;
        unsafe fn on<P: Path, G: BlockIo>(g: &[G]) -> bool {
            // SAFETY: the caller's contract.
            unsafe { P::nonfinite(g) }
        }
    }
    Ok(chunk_pass::<NonFinite>(simd, pool, grads)?.into_iter().any(|b| b))
}

/// A host buffer of any of the kernel's element types, to write (bytes: quantized moments).
pub enum HostMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
    F16(&'a mut [F16]),
    U8(&'a mut [u8]),
}

impl<'a> HostMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            HostMut::F32(s) => s.len(),
            HostMut::Bf16(s) => s.len(),
            HostMut::F16(s) => s.len(),
            HostMut::U8(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer as a gradient to read; `what` names it in the error (a uint8 buffer).
    pub fn into_grad(self, what: &str) -> Result<GradRef<'a>> {
        Ok(match self {
            HostMut::F32(s) => GradRef::F32(s),
            HostMut::Bf16(s) => GradRef::Bf16(s),
            HostMut::F16(s) => GradRef::F16(s),
            HostMut::U8(_) => {
                return Err(Error::Type(format!(
                    "{what}: dtype must be float32, bfloat16 or float16, got uint8"
                )))
            }
        })
    }
}

fn add_into<D: Elem, S: Elem>(dst: &mut [D], src: &[S]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::from_f32(d.to_f32() + s.to_f32());
    }
}

/// `dst += src` element by element, computed in f32 and rounded to `dst`'s dtype: the rounding
/// torch does when it adds a gradient into an existing one.
pub fn accumulate(pool: Pool<'_>, dst: HostMut<'_>, src: GradRef<'_>) -> Result<()> {
    if matches!(dst, HostMut::U8(_)) {
        return Err(Error::Type(
            "dst: a gradient is float32, bfloat16 or float16, not uint8".into(),
        ));
    }
    if dst.len() != src.len() || matches!(src, GradRef::InOut) {
        return Err(Error::Value(format!(
            "src: has {} elements, dst {}",
            src.len(),
            dst.len()
        )));
    }
    macro_rules! go {
        ($d:expr, $s:expr) => {{
            let pairs: Vec<_> = $d.chunks_mut(CHUNK).zip($s.chunks(CHUNK)).collect();
            for_each(pool, pairs, |(d, s)| add_into(d, s));
        }};
    }
    match (dst, src) {
        (HostMut::F32(d), GradRef::F32(s)) => go!(d, s),
        (HostMut::F32(d), GradRef::Bf16(s)) => go!(d, s),
        (HostMut::F32(d), GradRef::F16(s)) => go!(d, s),
        (HostMut::Bf16(d), GradRef::F32(s)) => go!(d, s),
        (HostMut::Bf16(d), GradRef::Bf16(s)) => go!(d, s),
        (HostMut::Bf16(d), GradRef::F16(s)) => go!(d, s),
        (HostMut::F16(d), GradRef::F32(s)) => go!(d, s),
        (HostMut::F16(d), GradRef::Bf16(s)) => go!(d, s),
        (HostMut::F16(d), GradRef::F16(s)) => go!(d, s),
        (HostMut::U8(_), _) | (_, GradRef::InOut) => unreachable!("refused above"),
    }
    Ok(())
}
