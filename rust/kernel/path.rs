//! The code paths of the kernel: one per SIMD choice, each the same block code compiled inside
//! functions with that path's `#[target_feature]` (the features from `isa.rs`'s one table,
//! [`simd_features`]), the scalar specification as a path of its own, and [`dispatch`]: the one
//! place a [`Simd`] choice becomes a code path.

use super::float::{body, body_inout, body_kahan, nonfinite_body, sq_norm_body, BlockIo, Lookahead};
use super::q8;
use super::reference;
use super::segment::{Consts, Kahan, OutMut, Q8Mut};
use crate::elem::{Bf16, Elem, F16};
use crate::error::{Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::isa::{simd_features, Avx2, Avx512, Avx512Bf16, Avx512Bf16Vbmi, Avx512Vbmi};
use crate::isa::{Generic, Simd};

/// The typed entry points of one code path. Every entry point of the kernel reaches a path
/// through [`dispatch`], which checks once that the CPU runs it.
pub(super) trait Path {
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
    ($name:ident, $isa:ty, $($features:tt)*) => {
        struct $name;
        impl Path for $name {
            #[inline]
            unsafe fn update<G: BlockIo, S: BlockIo, const AMS: bool>(
                c: &Consts, p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                out: &mut OutMut<'_>, next: &Lookahead,
            ) {
                $(#[target_feature(enable = $features)])*
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
                $(#[target_feature(enable = $features)])*
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
                $(#[target_feature(enable = $features)])*
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
                $(#[target_feature(enable = $features)])*
                unsafe fn f<G: BlockIo, S: BlockIo, const AMS: bool>(
                    c: &Consts, k: Kahan<'_>, g: &[G], m: &mut [S], v: &mut [S], vmax: &mut [S],
                ) {
                    unsafe { body_kahan::<$isa, G, S, AMS>(c, k.w, k.comp, g, m, v, vmax) }
                }
                unsafe { f::<G, S, AMS>(c, k, g, m, v, vmax) }
            }
            #[inline]
            unsafe fn sq_norm<G: BlockIo>(g: &[G]) -> f64 {
                $(#[target_feature(enable = $features)])*
                unsafe fn f<G: BlockIo>(g: &[G]) -> f64 {
                    unsafe { sq_norm_body::<$isa, G>(g) }
                }
                unsafe { f::<G>(g) }
            }
            #[inline]
            unsafe fn nonfinite<G: BlockIo>(g: &[G]) -> bool {
                $(#[target_feature(enable = $features)])*
                unsafe fn f<G: BlockIo>(g: &[G]) -> bool {
                    nonfinite_body(g)
                }
                unsafe { f::<G>(g) }
            }
        }
    };
}

path!(GenericPath, Generic,);
#[cfg(target_arch = "x86_64")]
simd_features!(Avx2, path!(Avx2Path, Avx2,));
#[cfg(target_arch = "x86_64")]
simd_features!(Avx512, path!(Avx512Path, Avx512,));
#[cfg(target_arch = "x86_64")]
simd_features!(Avx512Bf16, path!(Avx512Bf16Path, Avx512Bf16,));

/// A path that is `$base` but for the quantized moments, which run on `$isa` (its lookups in
/// registers) with `$features`: only `update_q8` is compiled again.
#[cfg(target_arch = "x86_64")]
macro_rules! lookup_path {
    ($name:ident, $base:ty, $isa:ty, $($features:tt)*) => {
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
                $(#[target_feature(enable = $features)])*
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
simd_features!(Avx512Vbmi, lookup_path!(Avx512VbmiPath, Avx512Path, Avx512Vbmi,));
#[cfg(target_arch = "x86_64")]
simd_features!(
    Avx512Bf16Vbmi,
    lookup_path!(Avx512Bf16VbmiPath, Avx512Bf16Path, Avx512Bf16Vbmi,)
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
pub(super) trait Visit {
    type Out;
    /// # Safety
    /// The CPU supports `P` (only [`dispatch`] calls this, after checking).
    unsafe fn visit<P: Path>(self) -> Self::Out;
}

/// The one place a [`Simd`] choice becomes a code path: checks that this CPU runs it, then
/// calls `v` with that path.
pub(super) fn dispatch<V: Visit>(simd: Simd, v: V) -> Result<V::Out> {
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
