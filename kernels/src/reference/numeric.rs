//! bf16 helpers and floating-point error bounds used by the combine references.
//!
//! bf16 conversions use `half::bf16::from_f32`, which rounds to nearest, ties to even (the same
//! as `__float2bfloat16_rn` / `cvt.rn.bf16.f32` on the GPU) and keeps NaN a NaN. Checked
//! exhaustively: for all 2^32 − NaN f32 inputs the results equal `__float2bfloat16_rn` compiled
//! on the host from CUDA 13.0.88's `cuda_bf16.hpp` (identical FNV-1a hash of all outputs).

use half::bf16;

/// Unit roundoff of f32 (2^-24).
pub const F32_UNIT_ROUNDOFF: f64 = 1.0 / 16_777_216.0;

/// f32 -> bf16, round to nearest even.
#[inline]
pub fn bf16_rn(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// bf16 values as little-endian bytes, the way they sit in GPU memory.
pub fn bf16_to_bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// Little-endian bytes back to bf16 values (`bytes.len()` must be even).
pub fn bf16_from_bytes(bytes: &[u8]) -> Vec<bf16> {
    assert!(bytes.len() % 2 == 0, "bf16_from_bytes: odd byte count {}", bytes.len());
    bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()
}

/// Distance between two adjacent bf16 values in the binade of `|x|`: `2^(e-7)` for
/// `|x|` in `[2^e, 2^(e+1))`; for subnormal magnitudes (below `2^-126`) it is the bf16
/// subnormal spacing `2^-133`.
pub fn ulp_bf16(x: f64) -> f64 {
    let a = x.abs();
    if !a.is_finite() {
        return f64::INFINITY;
    }
    if a < 2f64.powi(-126) {
        return 2f64.powi(-133);
    }
    // 2^(floor(log2 a) - 7): the biased f64 exponent minus 7, mantissa zero (exact, no libm).
    let biased = (a.to_bits() >> 52) & 0x7ff;
    f64::from_bits((biased - 7) << 52)
}

/// `γ_m = m·u / (1 − m·u)` with `u = 2^-24`: the classical bound on the relative error of a
/// recursive f32 summation of `m + 1` terms (in any order), relative to the sum of absolute
/// values of the terms (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2).
pub fn gamma_f32(m: usize) -> f64 {
    let mu = m as f64 * F32_UNIT_ROUNDOFF;
    mu / (1.0 - mu)
}

/// Bound on `|bf16(s) − exact|` where `s` is an f32 sum of terms whose exact sum is `exact` and
/// whose absolute values sum to `abs_sum`, computed with `f32_ops` rounding f32 operations
/// (additions, products, or fused multiply-adds, each rounding once) in any order:
/// `f32_err = γ_{f32_ops}·abs_sum`, then the final round-to-bf16 error `ulp_bf16(|exact| + f32_err)/2`.
/// A tiny relative slack (2^-50) covers the f64 evaluation of `exact` itself.
pub fn bf16_sum_bound(exact: f64, abs_sum: f64, f32_ops: usize) -> f64 {
    let f32_err = gamma_f32(f32_ops) * abs_sum;
    f32_err + 0.5 * ulp_bf16(exact.abs() + f32_err) + abs_sum * 2f64.powi(-50)
}

/// Bound on `|s − exact|` for an f32 result `s` (no final bf16 rounding), same arguments as
/// [`bf16_sum_bound`]. Zero when there is at most one term.
pub fn f32_sum_bound(abs_sum: f64, f32_ops: usize) -> f64 {
    gamma_f32(f32_ops) * abs_sum + abs_sum * 2f64.powi(-50)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even -> 1.
        assert_eq!(bf16_rn(1.0 + 2f32.powi(-8)).to_bits(), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1+2^-7 (odd mantissa) and 1+2^-6: ties to even -> 1+2^-6.
        assert_eq!(bf16_rn(1.0 + 3.0 * 2f32.powi(-8)).to_bits(), 0x3f82);
        // just above the midpoint rounds up
        assert_eq!(bf16_rn(f32::from_bits(0x3f80_8001)).to_bits(), 0x3f81);
    }

    #[test]
    fn ulp_matches_adjacent_bf16_values() {
        for bits in [0x3f80u16, 0x4000, 0x0080, 0x7f00, 0x3c00, 0xc2f0] {
            let x = bf16::from_bits(bits).to_f64();
            let next = bf16::from_bits(bits + 1).to_f64();
            assert_eq!(ulp_bf16(x), (next - x).abs(), "bits {bits:#x}");
        }
        assert_eq!(ulp_bf16(0.0), 2f64.powi(-133));
    }

    #[test]
    fn bytes_round_trip() {
        let v: Vec<bf16> = [1.0f32, -2.5, 3.0e-3].iter().map(|&x| bf16_rn(x)).collect();
        let b = bf16_to_bytes(&v);
        assert_eq!(b[0..2], 0x3f80u16.to_le_bytes());
        assert_eq!(bf16_from_bytes(&b), v);
    }
}
