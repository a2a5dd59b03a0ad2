//! The launcher and the rendezvous across real processes (no GPU needed): `deepep-gpu-tests`
//! has hidden `--selftest-*` flags that exercise them without touching CUDA.

use std::process::Command;

fn gpu_tests() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_deepep-gpu-tests"));
    // A rank environment inherited from the caller would turn the launcher into a rank.
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        c.env_remove(v);
    }
    c
}

fn run(c: &mut Command) -> (i32, String, String) {
    let o = c.output().expect("run deepep-gpu-tests");
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn three_ranks_rendezvous_and_prefix_output() {
    let (rc, out, err) = run(gpu_tests().args(["--nproc", "3", "--selftest-comm"]));
    assert_eq!(rc, 0, "stdout:\n{out}\nstderr:\n{err}");
    for r in 0..3 {
        assert!(out.contains(&format!("[rank {r}] gathered [\"rank 0 of 3\", \"rank 1 of 3\", \"rank 2 of 3\"]; broadcast \"hello from rank 0\"")), "{out}");
    }
    // rank 0's final line comes last and unprefixed
    assert_eq!(out.lines().last(), Some("comm ok: 3 ranks"), "{out}");
}

#[test]
fn failing_rank_is_named_as_the_cause() {
    let (rc, out, err) = run(gpu_tests().args(["--nproc", "3", "--selftest-comm", "--selftest-fail-rank", "1"]));
    assert_ne!(rc, 0, "{out}{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.contains("3 of 3 ranks failed: rank 1 exited with code 3"), "{err}");
    assert!(last.contains("rank 0 (a peer vanished)") && last.contains("rank 2 (a peer vanished)"), "{err}");
    assert!(err.contains("[rank 1] rank 1 exits with code 3"), "{err}");
}

#[test]
fn hanging_rank_is_killed_after_the_grace_period() {
    let t = std::time::Instant::now();
    let (rc, out, err) = run(gpu_tests()
        .args(["--nproc", "3", "--selftest-comm", "--selftest-fail-rank", "1", "--selftest-hang-rank", "2"])
        .env("DEEPEP_LAUNCH_GRACE_S", "1"));
    assert_ne!(rc, 0, "{out}{err}");
    assert!(t.elapsed().as_secs() < 30, "took {:?}", t.elapsed());
    let last = err.lines().last().unwrap_or_default();
    assert!(last.contains("rank 1 exited with code 3") && last.contains("rank 2 (killed by the launcher)"), "{err}");
    assert!(err.contains("launcher: killing rank 2"), "{err}");
}

#[test]
fn rank_env_without_a_peer_times_out_naming_the_missing_rank() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (rc, _out, err) = run(gpu_tests()
        .args(["--selftest-comm"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", port.to_string())
        .env("DEEPEP_RDZV_TIMEOUT_S", "0.5"));
    assert_ne!(rc, 0);
    assert!(err.contains("ranks [1] of 2 did not join"), "{err}");
}

#[test]
fn list_names_cases_without_a_gpu() {
    let (rc, out, err) = run(gpu_tests().arg("--list"));
    assert_eq!(rc, 0, "{err}");
    assert!(out.lines().any(|l| l == "selftest/gpu_wait_timeout_names_rank_phase"), "{out}");
}
