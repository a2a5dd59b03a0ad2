//! CPU tests of the internode mode's host-side planning: configuration and per-call validation
//! (every error names the problem and the fix), symmetric-buffer and handle layouts, and the
//! parameter block mirrored from `cuda/nvshmem/internode.cuh`.

use deepep_kernels::internode::plan::*;
use deepep_kernels::tensor::DType;

fn cfg(rph: usize) -> InternodeConfig {
    InternodeConfig::new(rph, 4096, 7168)
}

fn err(r: deepep_kernels::Result<()>) -> String {
    r.expect_err("expected a validation error").to_string()
}

#[test]
fn accepts_the_shapes_we_run() {
    // 2 GPUs as 2 hosts of 1 (the test machine), DeepEP's 2 x 8, and 4 x 8.
    cfg(1).validate(2, Some(132)).unwrap();
    cfg(8).validate(16, Some(132)).unwrap();
    cfg(4).validate(8, None).unwrap();
    cfg(8).validate(32, None).unwrap();
    cfg(2).validate(2, None).unwrap(); // one host of 2: only the NVLink hop
}

#[test]
fn ranks_per_host_must_divide_world_and_fit_a_mask() {
    let m = err(cfg(3).validate(8, None));
    assert!(m.contains("ranks_per_node") && m.contains("divide"), "{m}");
    let m = err(cfg(16).validate(32, None));
    assert!(
        m.contains("ranks_per_host 16") && m.contains("at most 8"),
        "{m}"
    );
    let m = err(cfg(1).validate(64, None));
    assert!(
        m.contains("64 hosts") && m.contains("raise ranks_per_host"),
        "{m}"
    );
    let m = err(cfg(0).validate(2, None));
    assert!(m.contains("ranks_per_node"), "{m}");
}

#[test]
fn num_sms_rules() {
    let mut c = cfg(1);
    c.num_sms = 23;
    let m = err(c.validate(2, None));
    assert!(m.contains("even") && m.contains("24"), "{m}");
    c.num_sms = 0;
    assert!(err(c.validate(2, None)).contains("even"));
    c.num_sms = 66;
    assert!(err(c.validate(2, None)).contains("2..=64"));
    c.num_sms = 64;
    let m = err(c.validate(2, Some(32)));
    assert!(m.contains("32 SMs") && m.contains("at most 32"), "{m}");
    // 256 ranks x 32 channels exceed the notify table; the message gives a num_sms that fits.
    let mut c = InternodeConfig::new(8, 128, 2048);
    c.num_sms = 64;
    let m = err(c.validate(256, None));
    assert!(m.contains("lower num_sms to at most 32"), "{m}");
    c.num_sms = 32;
    c.validate(256, None).unwrap();
}

#[test]
fn capacities_and_hidden() {
    let mut c = cfg(1);
    c.max_tokens_per_rank = 0;
    assert!(err(c.validate(2, None)).contains("max_tokens_per_rank"));
    // At most 64 publication rounds of 512 records per channel chunk.
    c.num_sms = 2;
    c.max_tokens_per_rank = 32768;
    c.validate(2, None).unwrap();
    c.max_tokens_per_rank = 32769;
    let m = err(c.validate(2, None));
    assert!(m.contains("raise num_sms to at least 4"), "{m}");
    let mut c = InternodeConfig::new(1, 128, 7000);
    let m = err(c.validate(2, None));
    assert!(m.contains("7000"), "{m}");
    c.hidden = 7168;
    c.max_topk = 33;
    assert!(err(c.validate(2, None)).contains("1..=32"));
    c.max_topk = 8;
    c.max_local_experts = 0;
    assert!(err(c.validate(2, None)).contains("max_local_experts"));
}

#[test]
fn per_call_checks_name_the_fix() {
    let c = cfg(1);
    let sym = SymLayout::new(&c, 2).unwrap();
    check_dispatch(&sym, 4096, 7168, 8, 256, DType::Bf16, c.max_local_experts).unwrap();
    check_dispatch(&sym, 0, 7168, 8, 16, DType::Fp8E4m3, c.max_local_experts).unwrap();
    let m = err(check_dispatch(
        &sym,
        4097,
        7168,
        8,
        256,
        DType::Bf16,
        c.max_local_experts,
    ));
    assert!(m.contains("max_tokens_per_rank >= 4097"), "{m}");
    // Smaller rows fit a buffer made for larger ones; larger or unaligned ones do not.
    check_dispatch(&sym, 16, 4096, 8, 256, DType::Bf16, c.max_local_experts).unwrap();
    let m = err(check_dispatch(
        &sym,
        16,
        8192,
        8,
        256,
        DType::Bf16,
        c.max_local_experts,
    ));
    assert!(m.contains("hidden >= 8192"), "{m}");
    let m = err(check_dispatch(
        &sym,
        16,
        4000,
        8,
        256,
        DType::Bf16,
        c.max_local_experts,
    ));
    assert!(m.contains("multiple of 128"), "{m}");
    let m = err(check_dispatch(
        &sym,
        16,
        7168,
        9,
        256,
        DType::Bf16,
        c.max_local_experts,
    ));
    assert!(m.contains('9'), "{m}");
    let m = err(check_dispatch(
        &sym,
        16,
        7168,
        8,
        257,
        DType::Bf16,
        c.max_local_experts,
    ));
    assert!(m.contains("257"), "{m}");
    let m = err(check_dispatch(
        &sym,
        16,
        7168,
        8,
        512,
        DType::Bf16,
        c.max_local_experts,
    ));
    assert!(m.contains("max_local_experts >= 256"), "{m}");
    let m = err(check_dispatch(
        &sym,
        16,
        7168,
        8,
        256,
        DType::F32,
        c.max_local_experts,
    ));
    assert!(m.contains("bf16 or fp8"), "{m}");
}

#[test]
fn symmetric_layout_is_aligned_and_disjoint() {
    for (world, rph, tokens, hidden, k, sms) in [
        (2, 1, 4096, 7168, 8, 24),
        (16, 8, 512, 2048, 1, 20),
        (8, 4, 1, 4096, 32, 2),
        (32, 8, 256, 7168, 6, 64),
    ] {
        let mut c = InternodeConfig::new(rph, tokens, hidden);
        c.max_topk = k;
        c.num_sms = sms;
        let sym = SymLayout::new(&c, world).unwrap();
        let mut ranges = sym.ranges();
        ranges.sort_by_key(|r| r.1);
        for w in ranges.windows(2) {
            assert!(
                w[0].1 + w[0].2 <= w[1].1,
                "{} overlaps {}: {ranges:?}",
                w[0].0,
                w[1].0
            );
        }
        for (name, off, _) in &ranges {
            assert_eq!(off % 128, 0, "{name} not 128-byte aligned");
        }
        let last = ranges.last().unwrap();
        assert!(last.1 + last.2 <= sym.total);
        // Signals come first so that one memset clears them.
        assert!(sym.signals_end <= sym.meta_send && sym.bar_sig == 0);
        assert_eq!(sym.num_hosts * rph, world);
        assert_eq!(sym.max_recv, world * tokens);
        assert_eq!(sym.rec_stride % 16, 0);
        if rph > 1 {
            assert!(sym.comb_in_half >= sym.max_recv * hidden * 2);
            assert!(sym.comb_w_half >= sym.max_recv * k);
        } else {
            assert_eq!(
                (sym.comb_in_half, sym.comb_w_half),
                (0, 0),
                "no staging with one GPU per host"
            );
        }
        // A handle for the largest token count fits its arrays in order.
        let h = HandleLayout::new(&sym, tokens);
        let offs = [
            h.send_slot,
            h.send_lmask,
            h.send_off,
            h.recv_off,
            h.rdma_off,
            h.fwd_base,
            h.fwd_mask,
            h.total,
        ];
        assert!(offs.windows(2).all(|w| w[0] < w[1]), "{h:?}");
        // recv_offsets() hands out exactly [world][C+1] entries, not the padding up to rdma_off
        // (DeepEP's recv_gbl_rank_prefix_sum, handle[-4], is read from them per source rank).
        assert_eq!(h.recv_off_end - h.recv_off, 4 * sym.world * (sym.num_channels + 1), "{h:?}");
        assert!(h.recv_off_end <= h.rdma_off);
        if (world, sms) == (16, 20) {
            // 16 ranks x 11 entries x 4 B = 704 B: padded to 768 before rdma_off (the old end)
            assert!(h.recv_off_end < h.rdma_off, "{h:?}");
        }
        assert!(h.send_lmask - h.send_slot >= 4 * tokens * sym.num_hosts);
        assert!(h.total - h.fwd_mask >= sym.num_hosts * tokens);
    }
}

#[test]
fn args_base_points_into_the_buffer() {
    let c = cfg(4);
    let sym = SymLayout::new(&c, 8).unwrap();
    let a = InternodeArgs::base(&sym, 6, 0x1000_0000);
    assert_eq!((a.my_host, a.my_local, a.num_hosts), (1, 2, 2));
    assert_eq!(a.rdma_recv, 0x1000_0000 + sym.rdma_recv as u64);
    assert_eq!(a.comb_w_half as usize, sym.comb_w_half);
    let h = HandleLayout::new(&sym, 100);
    let a = a.with_handle(&h, 0x2000_0000);
    assert_eq!(a.fwd_mask, 0x2000_0000 + h.fwd_mask as u64);
    assert_eq!(std::mem::size_of::<InternodeArgs>(), ARGS_SIZE);
    // Consecutive calls use different data-signal halves; calls two apart share one.
    let base = InternodeArgs::base(&sym, 6, 0x1000_0000);
    let (a1, a2, a3) = (
        base.with_seq(&sym, 1),
        base.with_seq(&sym, 2),
        base.with_seq(&sym, 3),
    );
    assert_eq!(a2.seq, 2);
    assert_ne!(a1.disp_sig, a2.disp_sig);
    assert_eq!(a1.disp_sig, a3.disp_sig);
    assert_eq!(
        a1.comb_sig - a2.comb_sig,
        (8 * sym.num_hosts * sym.num_channels) as u64
    );
    assert!(
        a1.disp_sig + (8 * sym.num_hosts * sym.num_channels) as u64
            <= 0x1000_0000 + sym.comb_sig as u64
    );
}
