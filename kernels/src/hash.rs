//! FNV-1a (64-bit): a small hash that every process, build and machine computes alike. It compares
//! values across ranks without sending them whole (the MPS pipe folder of an IPC record, NVSHMEM's
//! unique id in the logs) and derives the harness's per-case seeds. Not for security.
//! (`kernels/build.rs`, a build script that cannot use this crate, streams its own copy over the
//! device sources.)

/// FNV-1a of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::fnv1a;

    #[test]
    fn fnv1a_matches_its_published_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
