//! The runtime's own GPU test cases (`selftest/...`): kernel launches and their argument checks,
//! IPC stores between the ranks, a put/signal/wait ring, the bounded GPU wait and its error
//! record, event timing, NCCL and CUPTI, with the selftest kernels of `cuda/selftest.cu`.

use super::{Case, CaseResult, Skip, POISON_U32};
use deepep_kernels::error::{EpError, Phase};
use deepep_kernels::runtime::timing::{time_op, TimingOpts};
use deepep_kernels::runtime::{DeviceBuffer, IpcBuffer, LaunchCfg};
use std::time::{Duration, Instant};

/// The word `ep_selftest_pattern` writes at index `i` for `(seed, sender)` (mirror of
/// `ep_pattern` in `cuda/selftest.cu`).
pub fn selftest_pattern(seed: u32, sender: u32, i: u64) -> u32 {
    let mut x = ((seed as u64) << 32) ^ (sender as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    x as u32
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> CaseResult {
    if cond {
        Ok(())
    } else {
        Err(anyhow::anyhow!(msg()))
    }
}

fn first_mismatch(got: &[u32], want: impl Fn(usize) -> u32) -> Option<(usize, u32, u32)> {
    got.iter().enumerate().find(|(i, &g)| g != want(*i)).map(|(i, &g)| (i, g, want(i)))
}

/// The runtime's own cases (`selftest/...`), run before the families' cases.
pub fn cases() -> Vec<Case> {
    vec![
        Case::new("selftest/launch_checks_arguments", |c| {
            let k = c.gpu.kernel("selftest", "ep_fill_u32")?;
            ensure(k.param_sizes() == Some(&[8, 8, 4, 24][..]), || format!("ep_fill_u32 parameter sizes {:?}", k.param_sizes()))?;
            let e = c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![0u64, 0u64]).unwrap_err().to_string();
            ensure(e.contains("ep_fill_u32") && e.contains("parameter sizes"), || format!("unexpected error: {e}"))?;
            let e = c.gpu.launch(&k, &LaunchCfg::new(1, 2048), deepep_kernels::args![0u64, 0u64, 0u32]).unwrap_err().to_string();
            ensure(e.contains("2048 threads"), || format!("unexpected error: {e}"))?;
            let e = c.gpu.kernel("selftest", "no_such_kernel").unwrap_err().to_string();
            ensure(e.contains("ep_copy_16"), || format!("unexpected error: {e}"))
        }),
        Case::new("selftest/fill_and_copy", |c| {
            let n = 1_000_003usize; // words; not a multiple of the block size
            let src: Vec<u32> = (0..n as u64).map(|i| selftest_pattern(c.seed as u32, 99, i)).collect();
            let a = DeviceBuffer::from_slice(c.gpu, &src)?;
            let b = c.poisoned(n * 4)?;
            let n16 = (n * 4 / 16) as u64;
            let copy = c.gpu.kernel("selftest", "ep_copy_16")?;
            c.gpu.launch(&copy, &LaunchCfg::new(264, 256), deepep_kernels::args![a.ptr(), b.ptr(), n16])?;
            c.gpu.sync("ep_copy_16")?;
            let got = b.download::<u32>(c.gpu, n)?;
            let whole = n16 as usize * 4;
            if let Some((i, g, w)) = first_mismatch(&got, |i| if i < whole { src[i] } else { POISON_U32 }) {
                anyhow::bail!("copy: word {i} is {g:#x}, expected {w:#x}");
            }
            // Plain, cooperative and cluster launches exercise cuLaunchKernelEx's attribute paths.
            let fill = c.gpu.kernel("selftest", "ep_fill_u32")?;
            let sms = c.gpu.sm_count();
            let cfgs = [
                ("plain", LaunchCfg::new(sms, 256)),
                ("cooperative", LaunchCfg::new(2 * sms, 128).cooperative(true)),
                ("cluster 2x1x1", LaunchCfg::new(2 * sms, 128).cluster(2, 1, 1)),
            ];
            for (k, (what, cfg)) in cfgs.iter().enumerate() {
                let v = 0x1234_5670u32 + k as u32;
                c.gpu.launch(&fill, cfg, deepep_kernels::args![b.ptr(), n as u64, v])?;
                c.gpu.sync(what)?;
                let got = b.download::<u32>(c.gpu, n)?;
                if let Some((i, g, _)) = first_mismatch(&got, |_| v) {
                    anyhow::bail!("{what} fill: word {i} is {g:#x}, expected {v:#x}");
                }
            }
            // A cooperative grid larger than what fits at once is refused before launch.
            let e = c.gpu.launch(&fill, &LaunchCfg::new(10_000 * sms, 1024).cooperative(true), deepep_kernels::args![b.ptr(), 0u64, 0u32]);
            ensure(e.as_ref().is_err_and(|e| e.to_string().contains("cooperative launch")), || format!("oversized cooperative launch: {e:?}"))
        }),
        Case::new("selftest/ipc_all_to_all_stores", |c| {
            // Every rank writes its pattern into slot `rank` of every rank's IPC buffer over NVLink.
            let n = 262_147usize;
            let w = c.world();
            let ipc = IpcBuffer::new(c.gpu, c.comm, w * n * 4)?;
            ipc.local().fill_u32(c.gpu, POISON_U32)?;
            c.gpu.sync("poison")?;
            c.comm.barrier()?;
            let k = c.gpu.kernel("selftest", "ep_selftest_pattern")?;
            for p in 0..w {
                let dst = ipc.ptr(p) + (c.rank() * n * 4) as u64;
                c.gpu.launch(&k, &LaunchCfg::new(132, 256), deepep_kernels::args![dst, n as u64, c.seed as u32, c.rank() as i32])?;
            }
            c.gpu.sync("pattern stores to peers")?;
            c.comm.barrier()?;
            let got = ipc.local().download::<u32>(c.gpu, w * n)?;
            for s in 0..w {
                if let Some((i, g, want)) = first_mismatch(&got[s * n..(s + 1) * n], |i| selftest_pattern(c.seed as u32, s as u32, i as u64)) {
                    anyhow::bail!("slot of sender rank {s}: word {i} is {g:#x}, expected {want:#x}");
                }
            }
            c.comm.barrier()?; // peers are done reading our buffer before it is freed
            Ok(())
        }),
        Case::new("selftest/put_signal_wait_ring", |c| {
            // Ring: payload + release flag to the next rank; acquire-wait on our flag, copy out.
            let (w, me) = (c.world(), c.rank());
            let n16 = 65_536usize; // 1 MiB
            let flag_bytes = 256usize;
            let ipc = IpcBuffer::new(c.gpu, c.comm, flag_bytes + n16 * 16)?;
            let payload: Vec<u32> = (0..(n16 * 4) as u64).map(|i| selftest_pattern(c.seed as u32, me as u32, i)).collect();
            let src = DeviceBuffer::from_slice(c.gpu, &payload)?;
            let out = c.poisoned(n16 * 16)?;
            let value = ((c.seed as u32) & 0x3FFF_FFFF) | 1;
            c.comm.barrier()?;
            let next = (me + 1) % w;
            let prev = (me + w - 1) % w;
            let put = c.gpu.kernel("selftest", "ep_selftest_put_signal")?;
            let wait = c.gpu.kernel("selftest", "ep_selftest_wait_copy")?;
            let peer = ipc.ptr(next);
            c.gpu.launch(&put, &LaunchCfg::new(1, 1024), deepep_kernels::args![src.ptr(), peer + flag_bytes as u64, n16 as u64, peer, value as i32])?;
            let mine = ipc.ptr(me);
            c.gpu.launch(
                &wait,
                &LaunchCfg::new(1, 1024),
                deepep_kernels::args![mine, value as i32, mine + flag_bytes as u64, out.ptr(), n16 as u64, Phase::Barrier as i32, prev as i32],
            )?;
            c.gpu.sync("put/signal/wait ring")?;
            let got = out.download::<u32>(c.gpu, n16 * 4)?;
            if let Some((i, g, want)) = first_mismatch(&got, |i| selftest_pattern(c.seed as u32, prev as u32, i as u64)) {
                anyhow::bail!("payload from rank {prev}: word {i} is {g:#x}, expected {want:#x}");
            }
            c.comm.barrier()?;
            Ok(())
        }),
        Case::new("selftest/gpu_wait_timeout_names_rank_phase", |c| {
            // A wait on a flag nobody sets must end in EpError::GpuTimeout naming rank and phase,
            // not hang; afterwards the GPU is usable again.
            let flag = DeviceBuffer::zeroed(c.gpu, 16)?;
            let out = c.poisoned(16)?;
            let k = c.gpu.kernel("selftest", "ep_selftest_wait_copy")?;
            let old = c.gpu.device_timeout();
            c.gpu.set_device_timeout(Duration::from_millis(50));
            let peer = ((c.rank() + 1) % c.world()) as i32;
            let launched = c.gpu.launch(
                &k,
                &LaunchCfg::new(3, 64),
                deepep_kernels::args![flag.ptr(), 1i32, flag.ptr(), out.ptr(), 1u64, Phase::DispatchRecv as i32, peer],
            );
            let t0 = Instant::now();
            let r = launched.map_err(anyhow::Error::from).and_then(|_| c.gpu.sync("wait that must time out").map_err(Into::into));
            c.gpu.set_device_timeout(old);
            let secs = t0.elapsed().as_secs_f64();
            match r {
                Err(e) => match e.downcast_ref::<EpError>() {
                    Some(EpError::GpuTimeout { rank, phase, channel, peer: p, waited_ms, .. }) => {
                        ensure(*rank == c.rank() as i32, || format!("record names rank {rank}, expected {}", c.rank()))?;
                        ensure(phase == "dispatch/recv", || format!("record names phase {phase}"))?;
                        ensure((0..3).contains(channel) && *p == peer, || format!("channel {channel} peer {p}"))?;
                        ensure(*waited_ms >= 50.0 && secs < 10.0, || format!("waited {waited_ms} ms, host {secs} s"))?;
                        let msg = e.to_string();
                        ensure(msg.contains(&format!("rank {}", c.rank())) && msg.contains("dispatch/recv"), || msg.clone())?;
                    }
                    _ => anyhow::bail!("expected a GPU timeout error, got: {e:#}"),
                },
                Ok(()) => anyhow::bail!("a wait on a flag nobody sets returned without error"),
            }
            ensure(c.gpu.error_record().code == 0, || "error record not cleared".into())?;
            // The copy must not have happened, and the GPU must work again.
            let got = out.download::<u32>(c.gpu, 4)?;
            ensure(got.iter().all(|&x| x == POISON_U32), || format!("timed-out kernel still copied: {got:x?}"))?;
            flag.upload(c.gpu, &[1i32])?;
            c.gpu.launch(&k, &LaunchCfg::new(1, 64), deepep_kernels::args![flag.ptr(), 1i32, flag.ptr(), out.ptr(), 1u64, Phase::DispatchRecv as i32, peer])?;
            c.gpu.sync("wait on a set flag")?;
            Ok(())
        }),
        Case::new("selftest/event_timing_matches_spin", |c| {
            let k = c.gpu.kernel("selftest", "ep_selftest_spin")?;
            let ns = 200_000u64;
            let s = time_op(c.gpu, c.comm, TimingOpts { warmup: 2, reps: 11, flush_l2: true }, None, || {
                c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![ns])
            })?;
            ensure(s.reps == 11 && s.median_us >= 195.0 && s.median_us < 400.0, || format!("200 us spin measured {s:?}"))
        }),
        Case::new("selftest/nccl_all_to_all", |c| {
            if c.gpu.oversubscribed() {
                return Err(Skip(format!("{} ranks share each GPU; NCCL needs one GPU per rank", c.gpu.ranks_per_gpu())).into());
            }
            // Per-peer byte counts differ per (sender, receiver); contents are checked exactly.
            let (w, me) = (c.world(), c.rank());
            let count = |s: usize, r: usize| 4096 + 16 * ((s * 7 + r * 13 + (c.seed as usize % 5)) % 97);
            let send_counts: Vec<usize> = (0..w).map(|r| count(me, r)).collect();
            let recv_counts: Vec<usize> = (0..w).map(|s| count(s, me)).collect();
            let mut send = Vec::new();
            for (r, &bytes) in send_counts.iter().enumerate() {
                send.extend((0..bytes / 4).map(|i| selftest_pattern(c.seed as u32, (me * 64 + r) as u32, i as u64)));
            }
            let sbuf = DeviceBuffer::from_slice(c.gpu, &send)?;
            let total: usize = recv_counts.iter().sum();
            let rbuf = c.poisoned(total)?;
            let nccl = deepep_kernels::runtime::nccl::Nccl::new(c.gpu, c.comm)?;
            nccl.all_to_all_bytes(c.gpu, sbuf.ptr(), &send_counts, rbuf.ptr(), &recv_counts)?;
            c.gpu.sync("NCCL all-to-all")?;
            let got = rbuf.download::<u32>(c.gpu, total / 4)?;
            let mut off = 0;
            for (s, &bytes) in recv_counts.iter().enumerate() {
                let n = bytes / 4;
                if let Some((i, g, want)) = first_mismatch(&got[off..off + n], |i| selftest_pattern(c.seed as u32, (s * 64 + me) as u32, i as u64)) {
                    anyhow::bail!("bytes from rank {s}: word {i} is {g:#x}, expected {want:#x}");
                }
                off += n;
            }
            Ok(())
        }),
    ]
}

/// CUPTI's kernel timestamps: registered last, as it loads CUPTI into the process.
pub fn cupti_case() -> Case {
    Case::new("selftest/cupti_kernel_timestamps", |c| {
        // The bench's 'kernel us' path: CUPTI records of two spin kernels per repetition,
        // split at the L2-flush memsets, give spans of about 100 + 50 us.
        let timer = match deepep_kernels::runtime::cupti::kernel_timer() {
            Ok(t) => t,
            Err(e) => return Err(Skip(format!("CUPTI unavailable: {e}")).into()),
        };
        let flush = deepep_kernels::runtime::timing::L2Flush::new(c.gpu)?;
        let k = c.gpu.kernel("selftest", "ep_selftest_spin")?;
        let reps = 5;
        let acts = timer.record(|| {
            for _ in 0..reps {
                flush.flush(c.gpu)?;
                c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![100_000u64])?;
                c.gpu.launch(&k, &LaunchCfg::new(1, 32), deepep_kernels::args![50_000u64])?;
            }
            c.gpu.sync("spin kernels under CUPTI")
        })?;
        let kernels = acts.iter().filter(|a| a.kind == deepep_kernels::runtime::cupti::ActivityKind::Kernel).count();
        ensure(kernels == 2 * reps, || format!("{kernels} kernel records for {} launches", 2 * reps))?;
        let spans = deepep_kernels::runtime::cupti::spans_per_rep(&acts, flush.bytes() as u64, reps)
            .ok_or_else(|| anyhow::anyhow!("records not split into {reps} repetitions: {acts:?}"))?;
        ensure(spans.iter().all(|&s| (149.0..400.0).contains(&s)), || format!("spans {spans:?} us, expected ~150"))
    })
}
