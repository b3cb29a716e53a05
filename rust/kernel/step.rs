//! The step: segments validated, cut into chunks of at most [`CHUNK`] elements, grouped into
//! tasks (consecutive chunks one thread runs in order), run on the path [`dispatch`] picks, each
//! segment through one match on its moments' codec and gradient ([`run_segment`]).

use rayon::prelude::*;

use super::float::Lookahead;
use super::path::{dispatch, Path, Visit};
use super::segment::{GradRef, OutMut, Q8Mut, Segment, StateMut};
use super::{fp8, q8};
use crate::error::Result;
use crate::isa::Simd;

/// Elements per unit of parallel work: a multiple of [`LANES`](crate::isa::LANES), fixed, so that
/// chunk boundaries (and the order in which reductions add partial sums) never depend on the
/// number of threads.
pub const CHUNK: usize = 1 << 15;

/// Runs one (validated) segment on path `P`; `next` is what this thread updates after it.
///
/// # Safety
/// The CPU supports `P`.
unsafe fn run_segment<P: Path>(s: Segment<'_>, next: &Lookahead) {
    let Segment {
        consts,
        amsgrad,
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
        mut out,
        kahan,
    } = s;
    // The float moments' one match: `$f!(args.., amsgrad, m, v, x)` on their dtype.
    macro_rules! float_moments {
        ($f:ident $(, $a:expr)*) => {
            match (exp_avg, exp_avg_sq, max_exp_avg_sq) {
                (StateMut::F32(m), StateMut::F32(v), Some(StateMut::F32(x))) if amsgrad => $f!($($a,)* true, m, v, x),
                (StateMut::F32(m), StateMut::F32(v), _) => $f!($($a,)* false, m, v, &mut []),
                (StateMut::Bf16(m), StateMut::Bf16(v), Some(StateMut::Bf16(x))) if amsgrad => $f!($($a,)* true, m, v, x),
                (StateMut::Bf16(m), StateMut::Bf16(v), _) => $f!($($a,)* false, m, v, &mut []),
                _ => unreachable!("validated: moments share one dtype"),
            }
        };
    }
    if let StateMut::Q8 { .. } | StateMut::Fp8 { .. } = exp_avg {
        fn q(s: StateMut<'_>) -> Q8Mut<'_> {
            match s {
                StateMut::Q8 { codes, absmax } | StateMut::Fp8 { codes, scale: absmax } => Q8Mut { codes, absmax },
                _ => unreachable!("validated: moments share one codec"),
            }
        }
        let fp8 = matches!(exp_avg, StateMut::Fp8 { .. });
        let (m, v) = (q(exp_avg), q(exp_avg_sq));
        let x = if amsgrad { max_exp_avg_sq.map(q) } else { None };
        macro_rules! q8 {
            ($g:expr, $codec:ty) => {
                // SAFETY: lengths validated (whole blocks); path support is the caller's contract.
                unsafe {
                    if amsgrad {
                        P::update_q8::<_, $codec, true>(&consts, param, $g, m, v, x, &mut out, kahan)
                    } else {
                        P::update_q8::<_, $codec, false>(&consts, param, $g, m, v, x, &mut out, kahan)
                    }
                }
            };
        }
        macro_rules! codec {
            ($g:expr) => {
                if fp8 {
                    q8!($g, fp8::Fp8)
                } else {
                    q8!($g, q8::Map)
                }
            };
        }
        match grad {
            GradRef::F32(g) => codec!(Some(g)),
            GradRef::Bf16(g) => codec!(Some(g)),
            GradRef::F16(g) => codec!(Some(g)),
            GradRef::InOut => codec!(None::<&[f32]>),
        }
        return;
    }
    macro_rules! go {
        ($g:expr, $ams:literal, $m:expr, $v:expr, $x:expr) => {
            // SAFETY: lengths validated; path support is the caller's contract.
            unsafe {
                match kahan {
                    Some(k) => P::update_kahan::<_, _, $ams>(&consts, k, $g, $m, $v, $x),
                    None => P::update::<_, _, $ams>(&consts, param, $g, $m, $v, $x, &mut out, next),
                }
            }
        };
    }
    macro_rules! go_inout {
        ($o:expr, $ams:literal, $m:expr, $v:expr, $x:expr) => {{
            debug_assert!(kahan.is_none(), "validated: Kahan weights read their gradient");
            // SAFETY: as above.
            unsafe { P::update_inout::<_, _, $ams>(&consts, param, $o, $m, $v, $x) }
        }};
    }
    match grad {
        GradRef::F32(g) => float_moments!(go, g),
        GradRef::Bf16(g) => float_moments!(go, g),
        GradRef::F16(g) => float_moments!(go, g),
        GradRef::InOut => match std::mem::replace(&mut out, OutMut::None) {
            OutMut::Bf16(o) => float_moments!(go_inout, o),
            OutMut::F16(o) => float_moments!(go_inout, o),
            OutMut::None => unreachable!("validated: InOut has a copy buffer"),
        },
    }
}

/// Consecutive chunks run by one thread, in order, so that the end of one prefetches the start
/// of the next: tensors smaller than the prefetch distance would otherwise always start cold.
fn tasks<'a>(chunks: Vec<Segment<'a>>) -> Vec<Vec<Segment<'a>>> {
    let mut tasks = Vec::new();
    let mut cur = Vec::new();
    let mut len = 0;
    for c in chunks {
        len += c.len();
        cur.push(c);
        if len >= CHUNK {
            tasks.push(std::mem::take(&mut cur));
            len = 0;
        }
    }
    if !cur.is_empty() {
        tasks.push(cur);
    }
    tasks
}

/// Where the work runs: a thread pool, or (None) the calling thread.
pub type Pool<'p> = Option<&'p rayon::ThreadPool>;

pub(super) fn for_each<T: Send>(pool: Pool<'_>, items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    match pool {
        Some(p) if p.current_num_threads() > 1 => p.install(|| items.into_par_iter().for_each(f)),
        _ => items.into_iter().for_each(f),
    }
}

pub(super) fn map<T: Sync, R: Send>(pool: Pool<'_>, items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
    match pool {
        Some(p) if p.current_num_threads() > 1 => p.install(|| items.par_iter().map(f).collect()),
        _ => items.iter().map(f).collect(),
    }
}

/// Updates every segment: validates them all first (an error leaves every buffer untouched),
/// then runs them on `pool` in chunks of at most [`CHUNK`] elements.
pub fn adam_step(simd: Simd, pool: Pool<'_>, segments: Vec<Segment<'_>>) -> Result<()> {
    struct Step<'p, 'a> {
        pool: Pool<'p>,
        tasks: Vec<Vec<Segment<'a>>>,
    }
    impl Visit for Step<'_, '_> {
        type Out = ();
        unsafe fn visit<P: Path>(self) {
            for_each(self.pool, self.tasks, |task| {
                let mut it = task.into_iter().peekable();
                while let Some(s) = it.next() {
                    let next = Lookahead::of(it.peek());
                    // SAFETY: the CPU supports `P` (this visit's contract).
                    unsafe { run_segment::<P>(s, &next) };
                }
            })
        }
    }
    for (i, s) in segments.iter().enumerate() {
        s.validate().map_err(|e| e.context(&format!("segment {i}")))?;
    }
    let mut chunks = Vec::with_capacity(segments.len());
    for s in segments {
        s.chunks(CHUNK, &mut chunks);
    }
    dispatch(
        simd,
        Step {
            pool,
            tasks: tasks(chunks),
        },
    )
}
