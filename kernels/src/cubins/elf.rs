//! Minimal ELF64 little-endian symbol-table reader for cubins.
//!
//! Shared by `build.rs` (cross-checks that every parsed `extern "C" __global__` name was emitted)
//! and by the crate (`cubins::Cubin::symbols`, used by `tests/cubins.rs`). Only what a cubin needs:
//! section headers, `SHT_SYMTAB` and its linked string table.

/// One symbol of the ELF symbol table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symbol {
    pub name: String,
    /// `STT_*` type (0 notype, 1 object, 2 func, 3 section, ...).
    pub kind: u8,
    /// `STB_*` binding (0 local, 1 global, 2 weak).
    pub binding: u8,
    /// `st_other`; CUDA marks kernel entry points with [`STO_CUDA_ENTRY`].
    pub other: u8,
    /// Section index (0 = undefined).
    pub section: u16,
    pub size: u64,
}

pub const STT_OBJECT: u8 = 1;
pub const STT_FUNC: u8 = 2;
pub const STB_GLOBAL: u8 = 1;
/// `st_other` bit of a CUDA kernel entry point.
pub const STO_CUDA_ENTRY: u8 = 0x10;
/// `e_machine` of CUDA cubins.
pub const EM_CUDA: u16 = 190;

const SHT_SYMTAB: u32 = 2;

fn rd<const N: usize>(b: &[u8], off: usize) -> Result<[u8; N], String> {
    b.get(off..off + N)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| format!("ELF truncated: need {N} bytes at offset {off}, file has {}", b.len()))
}
fn u16_at(b: &[u8], off: usize) -> Result<u16, String> {
    Ok(u16::from_le_bytes(rd(b, off)?))
}
fn u32_at(b: &[u8], off: usize) -> Result<u32, String> {
    Ok(u32::from_le_bytes(rd(b, off)?))
}
fn u64_at(b: &[u8], off: usize) -> Result<u64, String> {
    Ok(u64::from_le_bytes(rd(b, off)?))
}
fn cstr(b: &[u8], off: usize) -> Result<String, String> {
    let tail = b.get(off..).ok_or_else(|| format!("ELF string offset {off} out of range"))?;
    let end = tail.iter().position(|&c| c == 0).ok_or("ELF string not NUL-terminated")?;
    Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
}

/// All symbols of every `SHT_SYMTAB` section. Errors name what is malformed.
pub fn symbols(b: &[u8]) -> Result<Vec<Symbol>, String> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" {
        return Err("not an ELF file (bad magic)".into());
    }
    if b[4] != 2 || b[5] != 1 {
        return Err(format!("unsupported ELF class/endianness ({}, {}); cubins are ELF64 little-endian", b[4], b[5]));
    }
    let shoff = u64_at(b, 0x28)? as usize;
    let shentsize = u16_at(b, 0x3A)? as usize;
    let shnum = u16_at(b, 0x3C)? as usize;
    if shentsize < 64 {
        return Err(format!("ELF section header size {shentsize} < 64"));
    }
    let sh = |i: usize| shoff + i * shentsize;
    let mut out = Vec::new();
    for i in 0..shnum {
        let h = sh(i);
        if u32_at(b, h + 4)? != SHT_SYMTAB {
            continue;
        }
        let off = u64_at(b, h + 0x18)? as usize;
        let size = u64_at(b, h + 0x20)? as usize;
        let link = u32_at(b, h + 0x28)? as usize;
        let entsize = (u64_at(b, h + 0x38)? as usize).max(24);
        if link >= shnum {
            return Err(format!("symbol table links to string section {link} of {shnum}"));
        }
        let stroff = u64_at(b, sh(link) + 0x18)? as usize;
        for k in 0..size / entsize {
            let e = off + k * entsize;
            let name_off = u32_at(b, e)? as usize;
            let info = rd::<1>(b, e + 4)?[0];
            out.push(Symbol {
                name: cstr(b, stroff + name_off)?,
                kind: info & 0xF,
                binding: info >> 4,
                other: rd::<1>(b, e + 5)?[0],
                section: u16_at(b, e + 6)?,
                size: u64_at(b, e + 16)?,
            });
        }
    }
    Ok(out)
}

/// Names of the defined global functions (kernel entry points and exported device functions).
pub fn global_functions(b: &[u8]) -> Result<Vec<String>, String> {
    Ok(symbols(b)?
        .into_iter()
        .filter(|s| s.kind == STT_FUNC && s.binding == STB_GLOBAL && s.section != 0)
        .map(|s| s.name)
        .collect())
}

/// `e_machine` of the image (cubins: [`EM_CUDA`]).
pub fn machine(b: &[u8]) -> Result<u16, String> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" {
        return Err("not an ELF file (bad magic)".into());
    }
    u16_at(b, 0x12)
}

/// The SM version the image was compiled for (`100` for sm_100a), from `e_flags`: bits 8-15
/// from ELF ABI version 8 on (CUDA 13's nvcc and nvlink: `0x64` for sm_100a, `0x67` for sm_103a),
/// bits 0-7 before.
pub fn sm_version(b: &[u8]) -> Result<u32, String> {
    machine(b)?;
    let flags = u32_at(b, 0x30)?;
    Ok(if b[8] >= 8 { (flags >> 8) & 0xff } else { flags & 0xff })
}

/// Names of the kernel entry points (global functions flagged [`STO_CUDA_ENTRY`]).
pub fn entry_points(b: &[u8]) -> Result<Vec<String>, String> {
    Ok(symbols(b)?
        .into_iter()
        .filter(|s| s.kind == STT_FUNC && s.section != 0 && s.other & STO_CUDA_ENTRY != 0)
        .map(|s| s.name)
        .collect())
}

/// `EIATTR_KPARAM_INFO` in a `.nv.info.<kernel>` section.
const EIATTR_KPARAM_INFO: u8 = 0x17;
/// `EIATTR_CBANK_PARAM_SIZE`: total parameter bytes of a kernel.
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;
/// `EIFMT_*` value formats of `.nv.info` entries.
const EIFMT_NVAL: u8 = 1;
const EIFMT_BVAL: u8 = 2;
const EIFMT_HVAL: u8 = 3;
const EIFMT_SVAL: u8 = 4;

/// Sections by name: (name, file offset, size).
fn sections(b: &[u8]) -> Result<Vec<(String, usize, usize)>, String> {
    symbols(b)?; // validates the header
    let shoff = u64_at(b, 0x28)? as usize;
    let shentsize = u16_at(b, 0x3A)? as usize;
    let shnum = u16_at(b, 0x3C)? as usize;
    let shstrndx = u16_at(b, 0x3E)? as usize;
    if shstrndx >= shnum {
        return Err(format!("section name table index {shstrndx} >= {shnum}"));
    }
    let names = u64_at(b, shoff + shstrndx * shentsize + 0x18)? as usize;
    (0..shnum)
        .map(|i| {
            let h = shoff + i * shentsize;
            Ok((cstr(b, names + u32_at(b, h)? as usize)?, u64_at(b, h + 0x18)? as usize, u64_at(b, h + 0x20)? as usize))
        })
        .collect()
}

/// Parameter information of one kernel from its `.nv.info.<kernel>` section.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParamInfo {
    /// Sizes in declaration order (`EIATTR_KPARAM_INFO`); empty when the cubin does not list them
    /// (images linked by `nvlink -rdc` keep only the total).
    pub sizes: Vec<usize>,
    /// Total parameter bytes (`EIATTR_CBANK_PARAM_SIZE`), when recorded.
    pub total: Option<usize>,
}

/// Parameter information of kernel `kernel`, as the driver sees it, available without a GPU;
/// `None` when the cubin has no `.nv.info.<kernel>` section.
pub fn kernel_params(b: &[u8], kernel: &str) -> Result<Option<ParamInfo>, String> {
    let want = format!(".nv.info.{kernel}");
    let Some((_, off, size)) = sections(b)?.into_iter().find(|s| s.0 == want) else { return Ok(None) };
    let mut params: Vec<(u16, usize)> = Vec::new();
    let mut total = None;
    let mut p = off;
    while p + 2 <= off + size {
        let (fmt, attr) = (rd::<1>(b, p)?[0], rd::<1>(b, p + 1)?[0]);
        match fmt {
            // Every entry has a 4-byte header: format, attribute, 16-bit value (or size).
            EIFMT_NVAL | EIFMT_BVAL => p += 4,
            EIFMT_HVAL => {
                if attr == EIATTR_CBANK_PARAM_SIZE {
                    total = Some(u16_at(b, p + 2)? as usize);
                }
                p += 4
            }
            EIFMT_SVAL => {
                let len = u16_at(b, p + 2)? as usize;
                if attr == EIATTR_KPARAM_INFO && len >= 12 {
                    let ordinal = u16_at(b, p + 4 + 4)?;
                    let packed = u32_at(b, p + 4 + 8)?;
                    params.push((ordinal, ((packed >> 18) & 0x3fff) as usize));
                }
                p += 4 + len;
            }
            // Unknown format: stop (what we need comes first).
            _ => break,
        }
    }
    params.sort_by_key(|x| x.0);
    for (i, (ord, _)) in params.iter().enumerate() {
        if *ord as usize != i {
            return Err(format!("{want}: parameter ordinals {:?} are not 0..{}", params.iter().map(|x| x.0).collect::<Vec<_>>(), params.len()));
        }
    }
    Ok(Some(ParamInfo { sizes: params.into_iter().map(|x| x.1).collect(), total }))
}
