//! The untested-architecture warning is printed where the first `Buffer` loads its cubins
//! (`cubins::require_for_cc`, called by `Gpu::module`), once per process, with a faked compute
//! capability and no GPU. Its own test binary: the warning's once-flag is per process.

use deepep_kernels::{arch, cubins};

#[test]
fn loading_cubins_for_an_unrecorded_architecture_uses_up_the_one_warning() {
    // A recorded architecture (Hopper has GPU records) warns never, however often it loads.
    assert!(cubins::RECORDED_ARCHS.contains(&"sm_90a"), "{:?}", cubins::RECORDED_ARCHS);
    if cubins::ARCHS.contains(&"sm_90a") {
        cubins::require_for_cc("layout", (9, 0), "GPU 0 (NVIDIA H200)").unwrap();
        assert!(cubins::untested_arch_warning((9, 0), "GPU 0").is_none());
    }
    let Some(untested) = arch::KNOWN.iter().find(|a| cubins::ARCHS.contains(&a.name) && !cubins::RECORDED_ARCHS.contains(&a.name))
    else {
        // A build for recorded architectures only (DEEPEP_CUDA_ARCHS=sm_90a): nothing to warn about.
        return;
    };
    let device = format!("rank 0: GPU 0 (faked compute capability {})", arch::cc_text(untested.cc));
    // Before the load the process has not warned yet ...
    assert!(cubins::untested_arch_warning(untested.cc, &device).is_some());
    let c = cubins::require_for_cc("layout", untested.cc, &device).unwrap();
    assert_eq!(c.arch, untested.name);
    // ... and the load printed it: the once-flag is used up, a second device stays quiet.
    assert_eq!(cubins::untested_arch_warning_once(untested.cc, "GPU 1"), None, "require_for_cc did not print the warning");
    cubins::require_for_cc("layout", untested.cc, "GPU 1").unwrap();
}
