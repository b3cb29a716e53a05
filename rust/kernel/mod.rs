//! The fused Adam/AdamW update over flat slices, and the read-only gradient passes.
//!
//! [`reference`] is the specification: one element at a time, torch's order of operations
//! (`torch.optim.adam._single_tensor_adam`). The fast paths process blocks of [`LANES`] lanes with
//! FMA and multiply by `1/sqrt(bc2)` instead of dividing; the tests bound their distance to the
//! reference. A partial block at the end of a slice is copied into a padded block and goes through
//! the very same code, so every element's result depends only on its own inputs: results are
//! bitwise identical however the work is split between threads.
//!
//! The rooms: `segment` (what one update is given, validated), `float` (the block code of float
//! moments and of Kahan weights), `q8` and `maps` (8-bit block-quantized moments), `reference`,
//! `passes` (gradient norm, non-finite check, accumulation), `tests`; here, the code paths (one
//! per SIMD choice), `dispatch`, and the step: chunks, tasks, one match on the moments' codec.

use rayon::prelude::*;

pub mod fp8;
mod maps;
pub mod q8;

use crate::elem::{Bf16, Elem, F16};
use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::isa::{Avx2, Avx512, Avx512Bf16, Avx512Bf16Vbmi, Avx512Vbmi};
use crate::isa::{Block, Generic, Isa, Simd, LANES};

/// Elements per unit of parallel work: a multiple of [`LANES`], fixed, so that chunk boundaries
/// (and the order in which reductions add partial sums) never depend on the number of threads.
pub const CHUNK: usize = 1 << 15;

mod segment;
pub use segment::*;

/// The specification: one element at a time, in torch's order of operations, no FMA.
pub mod reference;

mod float;
pub use float::BlockIo;
use float::*;

/// The typed entry points of one code path. Every entry point of the kernel reaches a path
/// through [`dispatch`], which checks once that the CPU runs it.
trait Path {
    /// # Safety
    /// As for [`body`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
        out: &mut OutMut<'_>,
        next: &Lookahead,
    );
    /// # Safety
    /// As for [`body_inout`].
    unsafe fn update_inout<O: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        o: &mut [O],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    );
    /// # Safety
    /// As for [`q8::body`].
    unsafe fn update_q8<G: BlockIo, C: q8::Codec, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: Option<&[G]>,
        m: Q8Mut<'_>,
        v: Q8Mut<'_>,
        x: Option<Q8Mut<'_>>,
        out: &mut OutMut<'_>,
        kahan: Option<Kahan<'_>>,
    );
    /// # Safety
    /// As for [`body_kahan`].
    unsafe fn update_kahan<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        k: Kahan<'_>,
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    );
    /// # Safety
    /// The CPU supports the path.
    unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64;
    /// # Safety
    /// The CPU supports the path.
    unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool;
}

macro_rules! path {
    ($name:ident, $isa:ty $(, $features:literal)?) => {
        struct $name;
        impl Path for $name {
            #[inline]
            unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts, p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                out: &mut OutMut<'_>, next: &Lookahead,
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo, S: BlockIo, const AMS: bool>(
                    c: &Consts, p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                    out: &mut OutMut<'_>, next: &Lookahead,
                ) {
                    unsafe { body::<$isa, G, S, AMS>(c, p, g, m, v, vmax, out, next) }
                }
                unsafe { f::<G, S, AMS>(c, p, g, m, v, vmax, out, next) }
            }
            #[inline]
            unsafe fn update_inout<O: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts, p: &mut [f32], o: &mut [O], m: &mut [S], v: &mut [S], vmax: &mut [S],
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<O: BlockIo, S: BlockIo, const AMS: bool>(
                    c: &Consts, p: &mut [f32], o: &mut [O], m: &mut [S], v: &mut [S], vmax: &mut [S],
                ) {
                    unsafe { body_inout::<$isa, O, S, AMS>(c, p, o, m, v, vmax) }
                }
                unsafe { f::<O, S, AMS>(c, p, o, m, v, vmax) }
            }
            #[inline]
            unsafe fn update_q8<G: BlockIo, C: q8::Codec, const AMS: bool>(
                c: &Consts, p: &mut [f32], g: Option<&[G]>, m: Q8Mut<'_>, v: Q8Mut<'_>, x: Option<Q8Mut<'_>>,
                out: &mut OutMut<'_>, kahan: Option<Kahan<'_>>,
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo, C: q8::Codec, const AMS: bool>(
                    c: &Consts, p: &mut [f32], g: Option<&[G]>, m: Q8Mut<'_>, v: Q8Mut<'_>, x: Option<Q8Mut<'_>>,
                    out: &mut OutMut<'_>, kahan: Option<Kahan<'_>>,
                ) {
                    unsafe { q8::body::<$isa, G, C, AMS>(c, p, g, m, v, x, out, kahan) }
                }
                unsafe { f::<G, C, AMS>(c, p, g, m, v, x, out, kahan) }
            }
            #[inline]
            unsafe fn update_kahan<G: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts, k: Kahan<'_>, g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
            ) {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo, S: BlockIo, const AMS: bool>(
                    c: &Consts, k: Kahan<'_>, g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                ) {
                    unsafe { body_kahan::<$isa, G, S, AMS>(c, k.w, k.comp, g, m, v, vmax) }
                }
                unsafe { f::<G, S, AMS>(c, k, g, m, v, vmax) }
            }
            #[inline]
            unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64 {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo>(g: &[G]) -> f64 {
                    unsafe { sq_norm_body::<$isa, G>(g) }
                }
                unsafe { f::<G>(g) }
            }
            #[inline]
            unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool {
                $(#[target_feature(enable = $features)])?
                unsafe fn f<G: BlockIo>(g: &[G]) -> bool {
                    nonfinite_body(g)
                }
                unsafe { f::<G>(g) }
            }
        }
    };
}

path!(GenericPath, Generic);
#[cfg(target_arch = "x86_64")]
path!(Avx2Path, Avx2, "avx2,fma,f16c");
#[cfg(target_arch = "x86_64")]
path!(Avx512Path, Avx512, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c");
#[cfg(target_arch = "x86_64")]
path!(
    Avx512Bf16Path,
    Avx512Bf16,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"
);

/// A path that is `$base` but for the quantized moments, which run on `$isa` (its lookups in
/// registers) with `$features`: only `update_q8` is compiled again.
#[cfg(target_arch = "x86_64")]
macro_rules! lookup_path {
    ($name:ident, $base:ty, $isa:ty, $features:literal) => {
        struct $name;
        impl Path for $name {
            #[inline]
            unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts,
                p: &mut [f32],
                g: &[G],
                m: &mut [S],
                v: &mut [S],
                vmax: &mut [S],
                out: &mut OutMut<'_>,
                next: &Lookahead,
            ) {
                // SAFETY: this path's CPU runs `$base`'s (its features are a subset).
                unsafe { <$base>::update::<G, S, AMS>(c, p, g, m, v, vmax, out, next) }
            }
            #[inline]
            unsafe fn update_inout<O: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts,
                p: &mut [f32],
                o: &mut [O],
                m: &mut [S],
                v: &mut [S],
                vmax: &mut [S],
            ) {
                // SAFETY: as above.
                unsafe { <$base>::update_inout::<O, S, AMS>(c, p, o, m, v, vmax) }
            }
            #[inline]
            unsafe fn update_q8<G: BlockIo, C: q8::Codec, const AMS: bool>(
                c: &Consts,
                p: &mut [f32],
                g: Option<&[G]>,
                m: Q8Mut<'_>,
                v: Q8Mut<'_>,
                x: Option<Q8Mut<'_>>,
                out: &mut OutMut<'_>,
                kahan: Option<Kahan<'_>>,
            ) {
                #[target_feature(enable = $features)]
                unsafe fn f<G: BlockIo, C: q8::Codec, const AMS: bool>(
                    c: &Consts,
                    p: &mut [f32],
                    g: Option<&[G]>,
                    m: Q8Mut<'_>,
                    v: Q8Mut<'_>,
                    x: Option<Q8Mut<'_>>,
                    out: &mut OutMut<'_>,
                    kahan: Option<Kahan<'_>>,
                ) {
                    unsafe { q8::body::<$isa, G, C, AMS>(c, p, g, m, v, x, out, kahan) }
                }
                unsafe { f::<G, C, AMS>(c, p, g, m, v, x, out, kahan) }
            }
            #[inline]
            unsafe fn update_kahan<G: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts,
                k: Kahan<'_>,
                g: &[G],
                m: &mut [S],
                v: &mut [S],
                vmax: &mut [S],
            ) {
                // SAFETY: as above.
                unsafe { <$base>::update_kahan::<G, S, AMS>(c, k, g, m, v, vmax) }
            }
            #[inline]
            unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64 {
                // SAFETY: as above.
                unsafe { <$base>::sq_norm::<G>(g) }
            }
            #[inline]
            unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool {
                // SAFETY: as above.
                unsafe { <$base>::nonfinite::<G>(g) }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
lookup_path!(
    Avx512VbmiPath,
    Avx512Path,
    Avx512Vbmi,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c"
);
#[cfg(target_arch = "x86_64")]
lookup_path!(
    Avx512Bf16VbmiPath,
    Avx512Bf16Path,
    Avx512Bf16Vbmi,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c"
);

/// The specification as a path: [`reference::update`], one element at a time.
struct ScalarPath;

/// In-place mode: the slot's gradient, read exactly as f32; the slot then holds the rounded
/// master, so that the reference's resync sees no edit and overwrites it with the new copy.
fn take_slot<O: Elem>(o: &mut [O], p: &[f32]) -> Vec<f32> {
    let g = o.iter().map(|x| x.to_f32()).collect();
    for (x, w) in o.iter_mut().zip(p) {
        *x = O::from_f32(*w);
    }
    g
}

impl Path for ScalarPath {
    unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
        out: &mut OutMut<'_>,
        _next: &Lookahead,
    ) {
        let x = if AMS { Some(vmax) } else { None };
        match out {
            OutMut::None => reference::update::<G, S, Bf16>(c, p, g, m, v, x, None),
            OutMut::Bf16(o) => reference::update(c, p, g, m, v, x, Some(&mut **o)),
            OutMut::F16(o) => reference::update(c, p, g, m, v, x, Some(&mut **o)),
        }
    }
    unsafe fn update_inout<O: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        o: &mut [O],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    ) {
        // The specification of the in-place mode: read the gradients, then run the plain update
        // with the copy written to the same buffer.
        let g = take_slot(o, p);
        reference::update(c, p, &g, m, v, if AMS { Some(vmax) } else { None }, Some(o));
    }
    unsafe fn update_q8<G: BlockIo, C: q8::Codec, const AMS: bool>(
        c: &Consts,
        p: &mut [f32],
        g: Option<&[G]>,
        m: Q8Mut<'_>,
        v: Q8Mut<'_>,
        x: Option<Q8Mut<'_>>,
        out: &mut OutMut<'_>,
        kahan: Option<Kahan<'_>>,
    ) {
        let (g, inout) = (g.unwrap_or(&[]), g.is_none());
        match out {
            OutMut::None => q8::update_ref::<G, Bf16, C, AMS>(c, p, g, m, v, x, None, false, kahan),
            OutMut::Bf16(o) => q8::update_ref::<G, Bf16, C, AMS>(c, p, g, m, v, x, Some(&mut **o), inout, None),
            OutMut::F16(o) => q8::update_ref::<G, F16, C, AMS>(c, p, g, m, v, x, Some(&mut **o), inout, None),
        }
    }
    /// The Kahan mode has no element-by-element specification of its own: it is the portable
    /// path's block code (the tests check its plumbing; torch-optimi checks its arithmetic).
    unsafe fn update_kahan<G: BlockIo, S: BlockIo, const AMS: bool>(
        c: &Consts,
        k: Kahan<'_>,
        g: &[G],
        m: &mut [S],
        v: &mut [S],
        vmax: &mut [S],
    ) {
        // SAFETY: the portable path runs on every CPU.
        unsafe { GenericPath::update_kahan::<G, S, AMS>(c, k, g, m, v, vmax) }
    }
    unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64 {
        g.iter().map(|x| (x.to_f32() as f64) * (x.to_f32() as f64)).sum()
    }
    unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool {
        g.iter().any(|x| !x.to_f32().is_finite())
    }
}

/// Something to run on whichever path [`dispatch`] picks.
trait Visit {
    type Out;
    /// # Safety
    /// The CPU supports `P` (only [`dispatch`] calls this, after checking).
    unsafe fn visit<P: Path>(self) -> Self::Out;
}

/// The one place a [`Simd`] choice becomes a code path: checks that this CPU runs it, then
/// calls `v` with that path.
fn dispatch<V: Visit>(simd: Simd, v: V) -> Result<V::Out> {
    if !simd.supported() {
        return Err(Error::Value(format!(
            "SIMD path {} is not supported by this CPU",
            simd.name()
        )));
    }
    // SAFETY: checked just above that this CPU runs `simd`.
    Ok(unsafe {
        match simd {
            Simd::Scalar => v.visit::<ScalarPath>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => v.visit::<Avx2Path>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => v.visit::<Avx512Path>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16 => v.visit::<Avx512Bf16Path>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Vbmi => v.visit::<Avx512VbmiPath>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512Bf16Vbmi => v.visit::<Avx512Bf16VbmiPath>(),
            _ => v.visit::<GenericPath>(),
        }
    })
}

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

/// Addresses of the next segment's streams, only ever prefetched (never dereferenced).
#[derive(Default)]
pub struct Lookahead {
    /// (start address, bytes per block) of each stream.
    streams: [(usize, usize); 6],
    count: usize,
}

impl Lookahead {
    fn of(s: Option<&Segment<'_>>) -> Lookahead {
        let mut l = Lookahead::default();
        let Some(s) = s else { return l };
        let mut add = |addr: usize, elem: usize| {
            l.streams[l.count] = (addr, elem * LANES);
            l.count += 1;
        };
        add(s.param.as_ptr() as usize, 4);
        match &s.grad {
            GradRef::F32(x) => add(x.as_ptr() as usize, 4),
            GradRef::Bf16(x) => add(x.as_ptr() as usize, 2),
            GradRef::F16(x) => add(x.as_ptr() as usize, 2),
            GradRef::InOut => match &s.out {
                OutMut::Bf16(x) => add(x.as_ptr() as usize, 2),
                OutMut::F16(x) => add(x.as_ptr() as usize, 2),
                OutMut::None => {}
            },
        }
        let mut state = |x: &StateMut<'_>| match x {
            StateMut::F32(x) => add(x.as_ptr() as usize, 4),
            StateMut::Bf16(x) => add(x.as_ptr() as usize, 2),
            StateMut::Q8 { codes, .. } | StateMut::Fp8 { codes, .. } => add(codes.as_ptr() as usize, 1),
        };
        state(&s.exp_avg);
        state(&s.exp_avg_sq);
        if let Some(x) = &s.max_exp_avg_sq {
            state(x);
        }
        l
    }

    /// Prefetches block `b` of every stream (past the segment's end is harmless: a hint).
    #[inline(always)]
    fn prefetch<I: Isa>(&self, b: usize) {
        for &(addr, bytes) in &self.streams[..self.count] {
            I::prefetch(addr.wrapping_add(b * bytes) as *const u8);
        }
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

fn for_each<T: Send>(pool: Pool<'_>, items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    match pool {
        Some(p) if p.current_num_threads() > 1 => p.install(|| items.into_par_iter().for_each(f)),
        _ => items.into_iter().for_each(f),
    }
}

fn map<T: Sync, R: Send>(pool: Pool<'_>, items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
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

mod passes;
pub use passes::{accumulate, grad_sq_norm, grads_nonfinite, HostMut};

#[cfg(test)]
mod tests;
