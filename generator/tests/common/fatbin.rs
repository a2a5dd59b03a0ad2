// A fat-binary writer for tests of the `.nv_fatbin` reader (`src/doctor/deepep.rs`): its unit
// tests `include!` this file, `tests/doctor.rs` uses it as a module. (No inner doc comment, which
// `include!` cannot take.)

/// Fat binary bytes with one entry per (kind 1 PTX / 2 ELF, arch such as 90), each with a
/// 64-byte entry header and 16 bytes of payload.
pub fn fatbin(images: &[(u16, u32)]) -> Vec<u8> {
    let mut entries = Vec::new();
    for &(kind, arch) in images {
        let mut h = [0u8; 64];
        h[0..2].copy_from_slice(&kind.to_le_bytes());
        h[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
        h[4..8].copy_from_slice(&64u32.to_le_bytes());
        h[8..16].copy_from_slice(&16u64.to_le_bytes());
        h[28..32].copy_from_slice(&arch.to_le_bytes());
        entries.extend_from_slice(&h);
        entries.extend_from_slice(&[0u8; 16]);
    }
    let mut out = Vec::new();
    out.extend_from_slice(&0xBA55_ED50u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    out.extend(entries);
    out
}
