//! CPU reference (oracle) of the expert-parallel dispatch/combine contract.
//!
//! Pure Rust, no GPU. Every GPU test case computes the expected outputs for *all* ranks locally
//! from the deterministic inputs of [`random`] (inputs depend only on `(seed, rank)`), runs the
//! kernels, and compares with the helpers in [`compare`] and the checkers of each module.
//!
//! | module | contents |
//! |---|---|
//! | [`numeric`] | bf16 <-> f32 (round to nearest even), bf16 ulp, f32 summation error bounds |
//! | [`fp8`] | e4m3 encode/decode exactly like `cvt.rn.satfinite.e4m3x2.f32`, per-token FP8 cast (DeepEP's LL arithmetic), UE8M0 packing, dequantization |
//! | [`layout`] | `is_token_in_rank`, per-rank/expert/node counts, channel prefix matrices, `send_head` |
//! | [`normal`] | normal (intranode = internode) dispatch, intranode and internode combine |
//! | [`low_latency`] | LL dispatch (multiset per local expert), packed-layout checker, weighted LL combine |
//! | [`random`] | deterministic inputs from `(seed, rank)`, ragged token counts |
//! | [`compare`] | bit-exact compare naming the first differing row/column, `calc_diff`, bounded compare |
//!
//! Conventions (see `kernels-arch`): bf16 is `half::bf16`, FP8 e4m3 is a raw `u8`, top-k ids are
//! `i64` `[N, K]` row-major with `-1` = unused, weights `f32`, FP8 scales `f32` `[N, H/128]`.

pub mod compare;
pub mod fp8;
pub mod layout;
pub mod low_latency;
pub mod normal;
pub mod numeric;
pub mod random;

pub use compare::{calc_diff, Bounded, CheckResult};
pub use fp8::{cast_per_token, Scales};
pub use layout::{layout, Layout};
pub use low_latency::{ll_combine, ll_combine_rank, ll_dispatch, LlDispatchOut, LlOptions};
pub use normal::{combine, combine_internode, combine_internode_rank, combine_rank, dispatch, dispatch_rank, CombineArgs, CombineOut, DispatchOut};

use half::bf16;

/// Token rows of one rank: bf16, or FP8 e4m3 bytes with per-128-channel f32 scales.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// `[N, H]` row-major.
    Bf16(Vec<bf16>),
    /// `data` `[N, H]` e4m3 bytes, `scales` `[N, H/128]` f32 row-major (`scale_inv`, i.e. the
    /// factor that multiplies the decoded e4m3 value).
    Fp8 { data: Vec<u8>, scales: Vec<f32> },
}

impl Payload {
    /// An empty payload of the same kind.
    pub fn empty_like(&self) -> Payload {
        match self {
            Payload::Bf16(_) => Payload::Bf16(Vec::new()),
            Payload::Fp8 { .. } => Payload::Fp8 { data: Vec::new(), scales: Vec::new() },
        }
    }

    pub fn is_fp8(&self) -> bool {
        matches!(self, Payload::Fp8 { .. })
    }

    /// Number of rows, given the hidden size.
    pub fn rows(&self, hidden: usize) -> usize {
        if hidden == 0 {
            return 0;
        }
        match self {
            Payload::Bf16(v) => v.len() / hidden,
            Payload::Fp8 { data, .. } => data.len() / hidden,
        }
    }

    /// Bytes of one row as stored on the GPU (bf16 little-endian, or the e4m3 bytes).
    pub fn row_bytes(&self, row: usize, hidden: usize) -> Vec<u8> {
        match self {
            Payload::Bf16(v) => numeric::bf16_to_bytes(&v[row * hidden..(row + 1) * hidden]),
            Payload::Fp8 { data, .. } => data[row * hidden..(row + 1) * hidden].to_vec(),
        }
    }

    /// Append row `row` of `src` (same kind) to `self`: a bit copy of the values and scales.
    pub fn push_row_from(&mut self, src: &Payload, row: usize, hidden: usize) {
        match (self, src) {
            (Payload::Bf16(dst), Payload::Bf16(s)) => dst.extend_from_slice(&s[row * hidden..(row + 1) * hidden]),
            (Payload::Fp8 { data, scales }, Payload::Fp8 { data: sd, scales: ss }) => {
                let g = hidden / fp8::GROUP;
                data.extend_from_slice(&sd[row * hidden..(row + 1) * hidden]);
                scales.extend_from_slice(&ss[row * g..(row + 1) * g]);
            }
            _ => panic!("Payload::push_row_from: mixing bf16 and fp8 payloads"),
        }
    }
}

/// The inputs of one rank: `n` tokens of `hidden` channels, each routed to `k` experts.
#[derive(Debug, Clone, PartialEq)]
pub struct RankInput {
    pub n: usize,
    pub hidden: usize,
    pub k: usize,
    pub x: Payload,
    /// `[n, k]` global expert ids, `-1` = unused slot.
    pub topk_idx: Vec<i64>,
    /// `[n, k]` gate weights.
    pub topk_weights: Vec<f32>,
}

impl RankInput {
    /// Shape checks of this input against `num_experts` (top-k bound `max_topk`).
    pub fn validate(&self, num_experts: usize, max_topk: usize) -> crate::Result<()> {
        use crate::validate as v;
        v::num_topk(self.k, max_topk)?;
        match &self.x {
            Payload::Bf16(x) => {
                v::hidden(self.hidden, 2)?;
                v::buffer_len("x (bf16)", x.len(), self.n * self.hidden, &format!("[{}, {}]", self.n, self.hidden))?;
            }
            Payload::Fp8 { data, scales } => {
                v::hidden(self.hidden, 1)?;
                v::buffer_len("x (fp8)", data.len(), self.n * self.hidden, &format!("[{}, {}]", self.n, self.hidden))?;
                v::fp8_scales(scales.len(), self.n, self.hidden)?;
            }
        }
        v::topk_idx(&self.topk_idx, self.n, self.k, num_experts)?;
        v::topk_weights(&self.topk_weights, self.n, self.k)
    }
}
