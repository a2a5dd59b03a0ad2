//! FP8 e4m3 (OCP "E4M3FN": bias 7, no infinities, NaN = `S.1111.111`, max finite 448) and the
//! per-token, per-128-channel FP8 cast of the contract (§7 "FP8 cast").
//!
//! # Encoding
//! [`e4m3_encode`] is bit-identical to `cvt.rn.satfinite.e4m3x2.f32` / `__nv_cvt_float_to_fp8(x,
//! __NV_SATFINITE, __NV_E4M3)` (CUDA 13.0 `cuda_fp8.hpp` host emulation): round to nearest, ties
//! to even (including into and out of the subnormal range, spacing `2^-9` below `2^-6`);
//! `|x| > 464` (448 + half an ulp) and ±inf saturate to ±448 (`0x7e`/`0xfe`); `|x| <= 2^-10`
//! flushes to a signed zero; any NaN gives the canonical `0x7f`. Verified exhaustively over all
//! 2^32 f32 inputs against `__nv_cvt_float_to_fp8` compiled on the host from CUDA 13.0.88's
//! `cuda_fp8.hpp` (identical FNV-1a hash of the 2^32 outputs).
//!
//! # Cast arithmetic (must match the device code bit for bit)
//! Per token and group `g` of 128 channels, all in f32 (IEEE, no fast-math, no FMA):
//! 1. `amax = fmaxf(1e-4f, max_i |x_i|)`
//! 2. without `round_scale`: `scale_inv = amax * (1.0f/448.0f)` and `scale = 448.0f / amax`
//!    (a correctly rounded division — compile the kernel without `--use_fast_math`);
//!    with `round_scale`: `e = ceil(log2(amax * (1.0f/448.0f)))` taken exactly from the f32 bits
//!    (exponent, +1 if any mantissa bit is set), `scale = 2^-e`, `scale_inv = 2^e`.
//! 3. `q_i = e4m3_satfinite(x_i * scale)`
//! 4. stored scale: `scale_inv` (f32), or with `use_ue8m0` the byte `bits(scale_inv) >> 23`;
//!    four consecutive groups per int32, lowest group in the lowest byte.
//!
//! This is DeepEP's low-latency arithmetic (`calculate_fp8_scales`): note `scale` is *not*
//! `1/scale_inv` — the two can differ by one f32 ulp, which flips rare e4m3 roundings.
//! `use_ue8m0` without `round_scale` is refused (UE8M0 can only hold powers of two).

use half::bf16;

/// Channels per scale group.
pub const GROUP: usize = 128;
/// Groups per packed UE8M0 int32.
pub const UE8M0_PER_I32: usize = 4;
/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Lower clamp of the per-group amax.
pub const AMAX_MARGIN: f32 = 1e-4;
/// `1.0f / 448.0f` rounded to f32, as the device constant.
pub const E4M3_MAX_INV: f32 = 1.0 / 448.0;

/// f32 -> e4m3 with round-to-nearest-even and saturation to ±448 (see module docs).
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f; // canonical NaN, whatever the input's sign
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = f64::from(x.abs());
    if a > 464.0 {
        return 0x7e | sign;
    }
    let code = if a < 2f64.powi(-6) {
        // Subnormal range: multiples of 2^-9; a code of 8 is the smallest normal (exp 1, man 0).
        (a * 512.0).round_ties_even() as u8
    } else {
        // a is a normal f32 here: its unbiased exponent is exact from the bits.
        let e = ((x.abs().to_bits() >> 23) & 0xff) as i32 - 127;
        let man = (a / 2f64.powi(e) - 1.0) * 8.0; // exact in f64
        let m = man.round_ties_even() as i32; // 0..=8; 8 carries into the exponent below
        (((e + 7) << 3) + m) as u8
    };
    code | sign
}

/// e4m3 -> f32 (exact). `0x7f`/`0xff` decode to NaN.
pub fn e4m3_decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xf);
    let man = f32::from(b & 0x7);
    if exp == 0xf && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    let mag = if exp == 0 { man * 2f32.powi(-9) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
    sign * mag
}

/// `(scale, scale_inv)` of one group from its amax (already clamped), per the module docs.
pub fn group_scale(amax: f32, round_scale: bool) -> (f32, f32) {
    if round_scale {
        let e = log2_ceil_bits(amax * E4M3_MAX_INV);
        (pow2(-e), pow2(e))
    } else {
        (E4M3_MAX / amax, amax * E4M3_MAX_INV)
    }
}

/// `ceil(log2(x))` for a positive normal f32, from its bits.
fn log2_ceil_bits(x: f32) -> i32 {
    let bits = x.to_bits();
    ((bits >> 23) & 0xff) as i32 - 127 + i32::from(bits & 0x7f_ffff != 0)
}

/// `2^e` as f32 for `-126 <= e <= 127`.
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The UE8M0 byte of a power-of-two scale: its biased f32 exponent.
pub fn ue8m0_byte(scale_inv: f32) -> u8 {
    (scale_inv.to_bits() >> 23) as u8
}

/// The scale a UE8M0 byte stands for: `2^(b − 127)`.
pub fn ue8m0_value(b: u8) -> f32 {
    f32::from_bits(u32::from(b) << 23)
}

/// Pack UE8M0 bytes `[n, groups]` into int32 `[n, groups/4]`, lowest group in the lowest byte.
pub fn pack_ue8m0(bytes: &[u8], n: usize, groups: usize) -> Vec<i32> {
    assert!(groups % UE8M0_PER_I32 == 0 && bytes.len() == n * groups, "pack_ue8m0: bad shape");
    bytes.chunks_exact(UE8M0_PER_I32).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Inverse of [`pack_ue8m0`].
pub fn unpack_ue8m0(packed: &[i32]) -> Vec<u8> {
    packed.iter().flat_map(|p| p.to_le_bytes()).collect()
}

/// Per-token scales of an FP8 tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    /// `[N, H/128]` f32 `scale_inv`.
    F32(Vec<f32>),
    /// `[N, H/512]` int32, four UE8M0 bytes each (lowest group in the lowest byte).
    Ue8m0(Vec<i32>),
}

impl Scales {
    /// The scale of every group as f32, `[N, H/128]`.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Scales::F32(v) => v.clone(),
            Scales::Ue8m0(p) => unpack_ue8m0(p).into_iter().map(ue8m0_value).collect(),
        }
    }
}

/// Result of [`quantize_rows`]: e4m3 bytes `[n, h]` and the f32 `scale_inv` of every group
/// `[n, h/128]` (before any UE8M0 encoding).
pub struct Quantized {
    pub data: Vec<u8>,
    pub scale_inv: Vec<f32>,
}

/// The cast of the module docs, steps 1-3, for `n` rows of `h` channels (`h % 128 == 0`).
pub fn quantize_rows(x: &[bf16], n: usize, h: usize, round_scale: bool) -> Quantized {
    assert!(h % GROUP == 0 && x.len() == n * h, "quantize_rows: need x of [n, h] with h % 128 == 0");
    let mut data = Vec::with_capacity(n * h);
    let mut scale_inv = Vec::with_capacity(n * h / GROUP);
    for group in x.chunks_exact(GROUP) {
        let amax = group.iter().fold(AMAX_MARGIN, |m, v| m.max(v.to_f32().abs()));
        let (scale, inv) = group_scale(amax, round_scale);
        scale_inv.push(inv);
        data.extend(group.iter().map(|v| e4m3_encode(v.to_f32() * scale)));
    }
    Quantized { data, scale_inv }
}

/// Per-token FP8 cast (§7): `x` bf16 `[n, h]` -> (e4m3 `[n, h]`, scales). Errors: `h` not a
/// multiple of 128 (512 with `ue8m0`), wrong `x` length, or `ue8m0` without `round_scale`.
pub fn cast_per_token(x: &[bf16], n: usize, h: usize, round_scale: bool, ue8m0: bool) -> crate::Result<(Vec<u8>, Scales)> {
    crate::validate::fp8_flags(round_scale, ue8m0)?;
    crate::validate::fp8_hidden(h, ue8m0)?;
    crate::validate::buffer_len("x (bf16)", x.len(), n * h, &format!("[{n}, {h}]"))?;
    let q = quantize_rows(x, n, h, round_scale);
    let scales = if ue8m0 {
        let bytes: Vec<u8> = q.scale_inv.iter().map(|&s| ue8m0_byte(s)).collect();
        Scales::Ue8m0(pack_ue8m0(&bytes, n, h / GROUP))
    } else {
        Scales::F32(q.scale_inv)
    };
    Ok((q.data, scales))
}

/// Dequantize e4m3 `[n, h]` with its scales to f32: `decode(q) * scale`.
pub fn dequantize(data: &[u8], scales: &Scales, n: usize, h: usize) -> Vec<f32> {
    let s = scales.to_f32();
    assert!(data.len() == n * h && s.len() == n * h / GROUP, "dequantize: bad shapes");
    data.iter().enumerate().map(|(i, &b)| e4m3_decode(b) * s[i / GROUP]).collect()
}

/// Dequantize and round to bf16 (what a "dequantized bf16 view" of FP8 rows holds).
pub fn dequantize_bf16(data: &[u8], scales: &Scales, n: usize, h: usize) -> Vec<bf16> {
    dequantize(data, scales, n, h).into_iter().map(bf16::from_f32).collect()
}
