//! `#[repr(C)]` mirrors of the kernel argument structs in `cuda/elastic.cuh`. Pointers are device
//! addresses as `u64` (0 = null). Sizes are asserted at compile time against the header's own
//! `static_assert`s.

/// Mirror of `ElasticArgs` (144 bytes): the buffer every kernel of the family takes first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ElasticArgs {
    pub peer_base: [u64; 8],
    pub off_call_seq: u64,
    pub off_ready: u64,
    pub off_rows_from: u64,
    pub off_comb_from: u64,
    pub off_notify_tok: u64,
    pub off_notify_exp: u64,
    pub off_data: u64,
    pub data_bytes: u64,
    pub rank: i32,
    pub num_ranks: i32,
    pub max_local_experts: i32,
    pub pad_: i32,
}

/// Mirror of `ElasticPlanParams` (48 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PlanParams {
    pub topk_idx: u64,
    pub dst_slot: u64,
    pub exp_pos: u64,
    pub send_counts: u64,
    pub num_tokens: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub num_ranks: i32,
}

/// Mirror of `ElasticDispatchParams` (120 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DispatchParams {
    pub x: u64,
    pub sf: u64,
    pub topk_idx: u64,
    pub topk_w: u64,
    pub dst_slot: u64,
    pub exp_pos: u64,
    pub send_counts: u64,
    pub topk_copy: u64,
    pub host_out: u64,
    pub sf_token_stride: i64,
    pub sf_pack_stride: i64,
    pub num_tokens: i32,
    pub hidden_bytes: i32,
    pub num_sf_packs: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub max_tokens: i32,
    pub fresh: i32,
    pub pad_: i32,
}

/// Mirror of `ElasticEpilogueParams` (136 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EpilogueParams {
    pub recv_x: u64,
    pub recv_sf: u64,
    pub recv_topk_idx: u64,
    pub recv_w: u64,
    pub meta: u64,
    pub psum_rank: u64,
    pub psum_expert: u64,
    pub unaligned: u64,
    pub stats: u64,
    pub sf_row_stride: i64,
    pub sf_pack_stride: i64,
    pub recv_rows: i32,
    pub meta_rows: i32,
    pub num_local_experts: i32,
    pub expert_alignment: i32,
    pub hidden_bytes: i32,
    pub num_sf_packs: i32,
    pub num_topk: i32,
    pub max_tokens: i32,
    pub expand: i32,
    pub fresh: i32,
    pub zero_padding: i32,
    pub pad_: i32,
}

/// Mirror of `ElasticCombineParams` (64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CombineParams {
    pub x: u64,
    pub topk_w: u64,
    pub meta: u64,
    pub psum_rank: u64,
    pub x_rows: i32,
    pub meta_rows: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub max_tokens: i32,
    pub expand: i32,
    pub per_rank: i32,
    pub nslots: i32,
}

/// Mirror of `ElasticReduceParams` (80 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ReduceParams {
    pub out: u64,
    pub out_w: u64,
    pub bias0: u64,
    pub bias1: u64,
    pub topk_idx: u64,
    pub send_counts: u64,
    pub num_tokens: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub per_rank: i32,
    pub nslots: i32,
    pub max_tokens: i32,
    pub pad_: i32,
}

const _: () = assert!(std::mem::size_of::<ElasticArgs>() == 144);
const _: () = assert!(std::mem::size_of::<PlanParams>() == 48);
const _: () = assert!(std::mem::size_of::<DispatchParams>() == 120);
const _: () = assert!(std::mem::size_of::<EpilogueParams>() == 136);
const _: () = assert!(std::mem::size_of::<CombineParams>() == 64);
const _: () = assert!(std::mem::size_of::<ReduceParams>() == 80);

// SAFETY: repr(C) plain data (u64 / i64 / i32 fields only), copied by value into kernel parameters.
unsafe impl crate::runtime::Pod for ElasticArgs {}
unsafe impl crate::runtime::Pod for PlanParams {}
unsafe impl crate::runtime::Pod for DispatchParams {}
unsafe impl crate::runtime::Pod for EpilogueParams {}
unsafe impl crate::runtime::Pod for CombineParams {}
unsafe impl crate::runtime::Pod for ReduceParams {}
