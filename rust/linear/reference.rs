//! The specification: each output element on its own, the float32 products added one after the
//! other, then `* scale + bias`, rounded once to the output dtype. It is the `scalar` path.

use super::{finish, Job, LinearPath, OutBlock};

/// `sum(x[r, i] * w[o, i])` over `i`, in order, in float32 (no FMA).
pub(crate) fn dot(job: &Job<'_>, r: usize, o: usize) -> f32 {
    let k = job.shape.k;
    let mut s = 0.0f32;
    for i in 0..k {
        s += job.x.get(r * k + i) * job.w.get(o, i, k);
    }
    s
}

/// The `scalar` path.
pub(crate) struct Scalar;

impl LinearPath for Scalar {
    type Prepared = ();
    fn prepare(_: &Job<'_>) {}
    unsafe fn block(job: &Job<'_>, _: &(), o0: usize, out: &mut OutBlock<'_>) {
        let len = match out {
            OutBlock::F32(rows) => rows.first().map_or(0, |r| r.len()),
            OutBlock::Bf16(rows) => rows.first().map_or(0, |r| r.len()),
        };
        for r in 0..job.shape.rows {
            for c in 0..len {
                let o = o0 + c;
                let y = finish(dot(job, r, o), 0.0, 1.0, job.scale[o], job.bias[o]);
                out.store::<1, 1>(r, c, 1, &[[y]]);
            }
        }
    }
}
