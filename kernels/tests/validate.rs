//! Argument validation: good values pass, bad values give `InvalidArgument` whose message names
//! the problem (the offending value) and the fix.

use deepep_kernels::validate as v;
use deepep_kernels::EpError;

/// Unwrap an `InvalidArgument` message and check it mentions every fragment.
fn msg(r: deepep_kernels::Result<()>, fragments: &[&str]) -> String {
    let e = r.expect_err("expected a validation error");
    let EpError::InvalidArgument(m) = &e else { panic!("expected InvalidArgument, got {e:?}") };
    for f in fragments {
        assert!(m.contains(f), "message lacks {f:?}: {m}");
    }
    // every message says what to do
    assert!(["use ", "pass ", "launch ", "set ", "route ", "enable ", "create ", "run "].iter().any(|w| m.contains(w)), "message names no fix: {m}");
    m.clone()
}

#[test]
fn rank_counts() {
    for r in [2, 4, 8] {
        v::intranode_ranks(r).unwrap();
    }
    for r in [0, 1, 3, 6, 16] {
        msg(v::intranode_ranks(r), &[&format!("got {r}"), "--nproc 2, 4 or 8"]);
    }
    v::low_latency_ranks(3, 9).unwrap();
    v::low_latency_ranks(8, 288).unwrap();
    msg(v::low_latency_ranks(3, 16), &["16 experts", "3 ranks", "multiple of 3", "18"]);
    msg(v::low_latency_ranks(0, 16), &["rank count is 0"]);
    v::internode_ranks(2, 1).unwrap();
    v::internode_ranks(16, 8).unwrap();
    msg(v::internode_ranks(6, 4), &["6 ranks", "ranks_per_node 4", "divisor of 6"]);
    msg(v::internode_ranks(4, 0), &["ranks_per_node 0"]);
    msg(v::experts(0, 2), &["0 experts"]);
}

#[test]
fn topk_bounds_are_parameters() {
    v::num_topk(32, v::MAX_TOPK_NORMAL).unwrap();
    v::num_topk(11, v::MAX_TOPK_LOW_LATENCY).unwrap();
    msg(v::num_topk(33, v::MAX_TOPK_NORMAL), &["top-k 33", "1..=32"]);
    msg(v::num_topk(12, v::MAX_TOPK_LOW_LATENCY), &["top-k 12", "1..=11"]);
    msg(v::num_topk(0, 32), &["top-k 0"]);
}

#[test]
fn topk_idx_range_and_shape() {
    v::topk_idx(&[0, -1, 15, 3], 2, 2, 16).unwrap();
    msg(v::topk_idx(&[0, -1, 16, 3], 2, 2, 16), &["topk_idx[1, 0] = 16", "[-1, 16)", "0..16", "-1 for an unused slot"]);
    msg(v::topk_idx(&[0, -3], 1, 2, 16), &["topk_idx[0, 1] = -3"]);
    msg(v::topk_idx(&[0, 1, 2], 2, 2, 16), &["topk_idx has 3 elements", "[2, 2] = 4"]);
    v::topk_weights(&[0.5, 0.25], 1, 2).unwrap();
    msg(v::topk_weights(&[0.5, f32::NAN], 1, 2), &["topk_weights[0, 1] = NaN", "finite"]);
    msg(v::topk_weights(&[0.5], 1, 2), &["topk_weights has 1 elements"]);
}

#[test]
fn hidden_and_fp8_shapes() {
    v::hidden(7168, 2).unwrap();
    v::hidden(16, 1).unwrap();
    v::hidden(8, 2).unwrap();
    msg(v::hidden(7164, 2), &["hidden 7164", "14328 B", "multiple of 8 for 2-byte"]);
    msg(v::hidden(100, 1), &["hidden 100", "multiple of 16 for 1-byte"]);
    msg(v::hidden(0, 2), &["hidden 0"]);
    v::fp8_scales(2 * 56, 2, 7168).unwrap();
    msg(v::fp8_scales(2 * 56 + 1, 2, 7168), &["FP8 scales has 113 elements", "[2, 56]"]);
    msg(v::fp8_scales(0, 2, 200), &["hidden 200", "multiple of 128"]);
    v::fp8_hidden(2560, true).unwrap();
    msg(v::fp8_hidden(2304, true), &["hidden 2304", "multiple of 512", "UE8M0"]);
    v::fp8_flags(true, true).unwrap();
    v::fp8_flags(false, false).unwrap();
    msg(v::fp8_flags(false, true), &["use_ue8m0 without round_scale", "enable round_scale"]);
}

#[test]
fn low_latency_limits() {
    let set = [2048, 4096, 7168];
    v::low_latency_hidden(7168, true, Some(&set)).unwrap();
    v::low_latency_hidden(1536, true, None).unwrap();
    v::low_latency_hidden(640, false, None).unwrap();
    msg(v::low_latency_hidden(5120, false, Some(&set)), &["[2048, 4096, 7168]", "got 5120"]);
    msg(v::low_latency_hidden(640, true, None), &["hidden % 512 == 0", "got 640", "dispatch bf16"]);
    v::low_latency_num_max(128, 2).unwrap();
    v::low_latency_num_max(2, 2).unwrap();
    msg(v::low_latency_num_max(3, 3), &["num_max_dispatch_tokens_per_rank 3", "% 4 == 0", "num_max = 4"]);
    msg(v::low_latency_num_max(0, 2), &["num_max > 0", "num_max = 2"]);
    v::tokens_within(128, 128, "LL dispatch").unwrap();
    msg(v::tokens_within(129, 128, "LL dispatch"), &["LL dispatch", "129 tokens", "128 tokens", "at least 129"]);
}

#[test]
fn counts_capacity_and_sms() {
    v::expert_alignment(1).unwrap();
    v::expert_alignment(128).unwrap();
    msg(v::expert_alignment(0), &["expert_alignment 0", "use 1"]);
    v::capacity("NVLink buffer", 10, 10, "raise it").unwrap();
    msg(v::capacity("NVLink buffer bytes", 11, 10, "create the buffer with at least 11 bytes"), &["need 11", "capacity is 10", "at least 11 bytes"]);
    v::num_sms(24, Some(132)).unwrap();
    msg(v::num_sms(23, None), &["num_sms 23", "even", "use e.g. 24"]);
    msg(v::num_sms(0, None), &["num_sms 0", "use e.g. 2"]);
    msg(v::num_sms(134, Some(132)), &["exceeds the 132 SMs", "at most 132"]);
    v::buffer_len("y", 6, 6, "[2, 3]").unwrap();
    msg(v::buffer_len("y", 5, 6, "[2, 3]"), &["y has 5 elements", "[2, 3] = 6"]);
}
