//! SHA-256 digests in the formats Nix and upstream use: lowercase hex (NVIDIA manifests,
//! PyPI), Nix base-32 (`nix-prefetch-url`), and SRI (`sha256-<base64>`, what `fetchurl`'s
//! `hash` takes). Directories are hashed as Nix does for `fetchzip`: SHA-256 of the NAR
//! serialisation.

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use base64::Engine as _;
use sha2::{Digest, Sha256 as Sha256Hasher};

use crate::error::{Error, Result};

/// A SHA-256 digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Sha256(pub [u8; 32]);

const SRI_PREFIX: &str = "sha256-";

/// The error for `value`, not a valid `what` (e.g. "SRI hash"), for the reason given.
fn bad_hash<'a>(what: &'static str, value: &'a str) -> impl Fn(&str) -> Error + 'a {
    move |reason| Error::BadHash {
        what,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

impl Sha256 {
    /// Parses 64 hex digits (upstream manifests use lowercase; uppercase is accepted).
    pub fn from_hex(s: &str) -> Result<Sha256> {
        let bad = bad_hash("sha256 hex", s);
        if s.len() != 64 {
            return Err(bad(&format!(
                "expected 64 hex digits, got {} characters",
                s.len()
            )));
        }
        let bytes = hex::decode(s).map_err(|e| bad(&e.to_string()))?;
        Ok(Sha256(
            bytes.try_into().expect("64 hex digits are 32 bytes"),
        ))
    }

    /// Parses an SRI string `sha256-<44 base64 chars>`.
    pub fn from_sri(s: &str) -> Result<Sha256> {
        let bad = bad_hash("SRI hash", s);
        let b64 = s
            .strip_prefix(SRI_PREFIX)
            .ok_or_else(|| bad("expected the prefix sha256-"))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| bad(&e.to_string()))?;
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| bad("digest is not 32 bytes"))?;
        Ok(Sha256(arr))
    }

    /// Parses a 52-character Nix base-32 string.
    pub fn from_nix32(s: &str) -> Result<Sha256> {
        let bad = bad_hash("Nix base-32 hash", s);
        if s.len() != 52 {
            return Err(bad(&format!("expected 52 characters, got {}", s.len())));
        }
        let bytes = nix_base32::from_nix_base32(s)
            .ok_or_else(|| bad("not Nix base-32 (alphabet 0-9a-z without e,o,u,t)"))?;
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| bad("digest is not 32 bytes"))?;
        Ok(Sha256(arr))
    }

    /// Parses any of hex, SRI or Nix base-32, told apart by shape.
    pub fn parse_any(s: &str) -> Result<Sha256> {
        if s.starts_with(SRI_PREFIX) {
            Sha256::from_sri(s)
        } else if s.len() == 52 {
            Sha256::from_nix32(s)
        } else {
            Sha256::from_hex(s)
        }
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn to_sri(&self) -> String {
        format!(
            "{SRI_PREFIX}{}",
            base64::engine::general_purpose::STANDARD.encode(self.0)
        )
    }

    pub fn to_nix32(&self) -> String {
        nix_base32::to_nix_base32(&self.0)
    }

    /// Digest of a byte slice.
    pub fn of_bytes(bytes: &[u8]) -> Sha256 {
        Sha256(Sha256Hasher::digest(bytes).into())
    }

    /// Digest of everything a reader yields, and the number of bytes read.
    pub fn of_reader(mut r: impl Read) -> io::Result<(Sha256, u64)> {
        let mut hasher = Sha256Hasher::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            hasher.update(&buf[..n]);
            total += n as u64;
        }
        Ok((Sha256(hasher.finalize().into()), total))
    }

    /// Flat digest and size of a file.
    pub fn of_file(path: &Path) -> Result<(Sha256, u64)> {
        let f = File::open(path).map_err(|e| Error::io(path, e))?;
        Sha256::of_reader(f).map_err(|e| Error::io(path, e))
    }

    /// NAR digest of a path (directory, file or symlink), as `nix hash path` computes it.
    pub fn of_nar(path: &Path) -> Result<Sha256> {
        let enc = nix_nar::Encoder::new(path)
            .map_err(|e| Error::io(path, io::Error::other(e.to_string())))?;
        let (digest, _) = Sha256::of_reader(enc).map_err(|e| Error::io(path, e))?;
        Ok(digest)
    }
}

impl fmt::Display for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vectors from the NVSHMEM facts sheet: NVIDIA's hex for three tarballs and the SRI /
    /// nix32 forms computed independently.
    const VECTORS: &[(&str, &str, &str)] = &[
        (
            "72a788ef5723a30d8882b193f0a513f454ecaee3ab5a225a5c43db79d433ef66",
            "sha256-cqeI71cjow2IgrGT8KUT9FTsruOrWiJaXEPbedQz72Y=",
            "0rpg6ga7kns3bid24nmbwfpfqm7l2fjz14xiha40v8r3azpqi9vj",
        ),
        (
            "18f12807c23bc5b270581af1f9bafd540369da783e557171558887623d77842c",
            "sha256-GPEoB8I7xbJwWBrx+br9VANp2ng+VXFxVYiHYj13hCw=",
            "0b44fwyn51w8amqp2m9yg3d6j0slznxgkw8sb1qb5i9vq83jiw8q",
        ),
        (
            "c06d44aa15eed01299366509788daf174456d492df94c8a616766c43b819afab",
            "sha256-wG1EqhXu0BKZNmUJeI2vF0RW1JLflMimFnZsQ7gZr6s=",
            "1axg36w46v3n2skci56zjba5ci0pmy6ph2b56sci5l7f2nm48vf0",
        ),
    ];

    #[test]
    fn conversions_match_known_values() {
        for (hex, sri, nix32) in VECTORS {
            let h = Sha256::from_hex(hex).unwrap();
            assert_eq!(h.to_sri(), *sri);
            assert_eq!(h.to_nix32(), *nix32);
            assert_eq!(Sha256::from_sri(sri).unwrap(), h);
            assert_eq!(Sha256::from_nix32(nix32).unwrap(), h);
            assert_eq!(Sha256::parse_any(nix32).unwrap().to_hex(), *hex);
        }
    }

    #[test]
    fn bad_hex_is_rejected_with_reason() {
        let e = Sha256::from_hex("zz").unwrap_err().to_string();
        assert!(e.contains("64 hex digits"), "{e}");
        let e = Sha256::from_hex(&"g".repeat(64)).unwrap_err().to_string();
        assert!(e.contains("sha256 hex"), "{e}");
        assert!(Sha256::from_sri("sha512-abc").is_err());
        assert!(Sha256::from_nix32(&"e".repeat(52)).is_err());
    }

    #[test]
    fn empty_input_digest() {
        // SHA-256 of the empty string, a published constant.
        assert_eq!(
            Sha256::of_bytes(b"").to_hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
