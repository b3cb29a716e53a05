//! The specification: one element at a time, in torch's order of operations
//! (`torch.optim.adam._single_tensor_adam`), no FMA.

use super::segment::{nan_max, Consts};
use crate::elem::Elem;

#[allow(clippy::too_many_arguments)]
pub fn update<G: Elem, S: Elem, O: Elem>(
    c: &Consts,
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    mut vmax: Option<&mut [S]>,
    mut out: Option<&mut [O]>,
) {
    for i in 0..p.len() {
        if let Some(o) = out.as_deref() {
            if O::from_f32(p[i]) != o[i] {
                p[i] = o[i].to_f32();
            }
        }
        let mut grad = g[i].to_f32() * c.gscale;
        if c.use_l2 {
            grad += c.l2 * p[i];
        }
        let param = p[i] * c.decay;
        let mut ea = m[i].to_f32();
        ea = ea + c.b1c * (grad - ea);
        let mut eas = v[i].to_f32();
        eas = eas * c.b2 + c.b2c * grad * grad;
        m[i] = S::from_f32(ea);
        v[i] = S::from_f32(eas);
        let mut vhat = eas;
        if let Some(vm) = vmax.as_deref_mut() {
            vhat = nan_max(vm[i].to_f32(), eas);
            vm[i] = S::from_f32(vhat);
        }
        let denom = vhat.sqrt() / c.bc2_sqrt + c.eps;
        p[i] = param + (-c.step_size) * (ea / denom);
        if let Some(o) = out.as_deref_mut() {
            o[i] = O::from_f32(p[i]);
        }
    }
}
