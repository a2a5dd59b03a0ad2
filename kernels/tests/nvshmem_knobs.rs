//! Knob logic (DeepEP buffer.py semantics, user value wins unless invalid) and bootstrap choice.

use std::collections::BTreeMap;

use deepep_kernels::nvshmem::binding::{Bootstrap, PmiFlavor};
use deepep_kernels::nvshmem::knobs::{plan, KnobRequest, Source};

fn env(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn ll() -> KnobRequest {
    KnobRequest::low_latency(128, 144)
}

#[test]
fn deepep_defaults_for_low_latency() {
    let p = plan(&env(&[]), &ll()).unwrap();
    assert_eq!(p.get("NVSHMEM_DISABLE_P2P"), Some("0"));
    assert_eq!(p.get("NVSHMEM_IB_ENABLE_IBGDA"), Some("1"));
    assert_eq!(p.get("NVSHMEM_IBGDA_NUM_RC_PER_PE"), Some("144"));
    assert_eq!(p.get("NVSHMEM_QP_DEPTH"), Some("1024"));
    assert_eq!(p.get("NVSHMEM_MAX_TEAMS"), Some("7"));
    assert_eq!(p.get("NVSHMEM_CUMEM_GRANULARITY"), Some("536870912"));
    assert_eq!(p.get("NVSHMEM_DISABLE_NVLS"), Some("1"));
    assert_eq!(p.get("NVSHMEM_DISABLE_MNNVL"), Some("1"));
    assert_eq!(p.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"), Some("lo"));
    assert_eq!(p.bootstrap, Bootstrap::UniqueId);
    assert!(p.knobs.iter().all(|k| k.source == Source::Default));
}

#[test]
fn nvlink_disallowed_and_mnnvl_allowed() {
    let mut r = KnobRequest::internode(24);
    r.allow_nvlink_for_low_latency = false;
    r.allow_mnnvl = true;
    let p = plan(&env(&[("MASTER_ADDR", "10.0.0.1")]), &r).unwrap();
    assert_eq!(p.get("NVSHMEM_DISABLE_P2P"), Some("1"));
    assert_eq!(p.get("NVSHMEM_DISABLE_MNNVL"), None);
    assert_eq!(p.get("NVSHMEM_IBGDA_NUM_RC_PER_PE"), Some("24"));
    assert_eq!(p.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"), None, "multi-host: let NVSHMEM pick the interface");
}

#[test]
fn valid_user_values_win() {
    let user = [
        ("NVSHMEM_DISABLE_P2P", "1"),
        ("NVSHMEM_IB_ENABLE_IBGDA", "0"),
        ("NVSHMEM_IBGDA_NUM_RC_PER_PE", "8"),
        ("NVSHMEM_QP_DEPTH", "258"),
        ("NVSHMEM_MAX_TEAMS", "16"),
        ("NVSHMEM_CUMEM_GRANULARITY", "1g"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
        ("NVSHMEM_DISABLE_MNNVL", "0"),
        ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "eth0"),
    ];
    let p = plan(&env(&user), &ll()).unwrap();
    // NVSHMEM_DISABLE_NVLS is 1 whatever is asked (nvls_can_never_be_enabled).
    for (k, v) in user.into_iter().filter(|(k, _)| *k != "NVSHMEM_DISABLE_NVLS") {
        assert_eq!(p.get(k), Some(v), "{k}");
        assert_eq!(p.knobs.iter().find(|x| x.name == k).unwrap().source, Source::User, "{k}");
    }
}

/// Asserts that the environment `kv` is refused for the low-latency request with a message naming
/// every one of `needles`.
fn refused(kv: &[(&str, &str)], needles: &[&str]) {
    let e = plan(&env(kv), &ll()).unwrap_err().to_string();
    assert!(needles.iter().all(|n| e.contains(n)), "{kv:?}: {e}");
}

#[test]
fn qp_depth_below_the_token_bound_is_refused() {
    // 2 * (128 + 1) = 258
    refused(&[("NVSHMEM_QP_DEPTH", "257")], &["NVSHMEM_QP_DEPTH", "258"]);
    refused(&[("NVSHMEM_QP_DEPTH", "deep")], &["not an integer"]);
    // Internode has no token bound.
    assert!(plan(&env(&[("NVSHMEM_QP_DEPTH", "64")]), &KnobRequest::internode(24)).is_ok());
}

#[test]
fn nvls_can_never_be_enabled() {
    for v in ["0", "false", "no"] {
        refused(&[("NVSHMEM_DISABLE_NVLS", v)], &["NVLink multicast", "set it to 1"]);
    }
}

#[test]
fn cumem_granularity_must_be_at_least_256_mib() {
    refused(&[("NVSHMEM_CUMEM_GRANULARITY", "128m")], &["256 MiB", "536870912"]);
    refused(&[("NVSHMEM_CUMEM_GRANULARITY", "268435457")], &["multiple of 2 MiB"]);
    assert!(plan(&env(&[("NVSHMEM_CUMEM_GRANULARITY", "268435456")]), &ll()).is_ok());
}

#[test]
fn other_invalid_values_are_refused_with_the_range() {
    refused(&[("NVSHMEM_MAX_TEAMS", "6")], &["7..=1024"]);
    refused(&[("NVSHMEM_IBGDA_NUM_RC_PER_PE", "0")], &["1..=1024"]);
    refused(&[("NVSHMEM_DISABLE_P2P", "maybe")], &["not a boolean"]);
    let e = plan(&env(&[]), &KnobRequest::low_latency(20000, 8)).unwrap_err().to_string();
    assert!(e.contains("16383"), "{e}");
}

#[test]
fn slurm_pmi_bootstraps_are_translated_to_nvshmem_spelling() {
    for (v, fl, name) in [("PMI2", PmiFlavor::Pmi2, "PMI-2"), ("pmix", PmiFlavor::Pmix, "PMIX"), ("PMI-2", PmiFlavor::Pmi2, "PMI-2")] {
        let p = plan(&env(&[("NVSHMEM_BOOTSTRAP", v)]), &ll()).unwrap();
        assert_eq!(p.bootstrap, Bootstrap::Pmi(fl));
        assert_eq!(p.get("NVSHMEM_BOOTSTRAP"), Some("PMI"));
        assert_eq!(p.get("NVSHMEM_BOOTSTRAP_PMI"), Some(name));
        assert_eq!(p.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"), None);
    }
    let p = plan(&env(&[("NVSHMEM_BOOTSTRAP", "PMI"), ("NVSHMEM_BOOTSTRAP_PMI", "PMIX")]), &ll()).unwrap();
    assert_eq!(p.bootstrap, Bootstrap::Pmi(PmiFlavor::Pmix));
    refused(&[("NVSHMEM_BOOTSTRAP", "MPI")], &["NVSHMEM_BOOTSTRAP", "PMI2"]);
    refused(&[("NVSHMEM_BOOTSTRAP", "PMI"), ("NVSHMEM_BOOTSTRAP_PMI", "PMI-3")], &["PMI-2 or PMIX"]);
}
