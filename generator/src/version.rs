//! Release versions: dotted numeric (`3.3.9`, `3.3.20`), compared numerically.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// The oldest NVSHMEM release DeepEP supports. DeepEP's README requires NVSHMEM >= 3.3.9
/// (the first release that works without DeepEP's own NVSHMEM patch), so nothing older is
/// ever locked.
pub const DEEPEP_MIN_NVSHMEM: &str = "3.3.9";

/// A dotted numeric version such as `3.3.20`. Ordering is numeric per component, and
/// trailing zero components are insignificant (`3.4.5 == 3.4.5.0`), matching PEP 440
/// release-segment comparison.
#[derive(Debug, Clone, Eq)]
pub struct Version {
    parts: Vec<u32>,
    text: String,
}

impl Version {
    /// The canonical text as it appeared upstream (used for keys and file names).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Components with trailing zeros removed (the comparison key).
    fn key(&self) -> &[u32] {
        let mut end = self.parts.len();
        while end > 1 && self.parts[end - 1] == 0 {
            end -= 1;
        }
        &self.parts[..end]
    }

    /// The DeepEP floor as a `Version`.
    pub fn deepep_min() -> Version {
        DEEPEP_MIN_NVSHMEM
            .parse()
            .expect("constant is a valid version")
    }
}

impl FromStr for Version {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::BadVersion(s.to_string());
        if s.is_empty() || s.len() > 32 {
            return Err(bad());
        }
        let parts = s
            .split('.')
            .map(|p| {
                if p.is_empty()
                    || !p.bytes().all(|b| b.is_ascii_digit())
                    || (p.len() > 1 && p.starts_with('0'))
                {
                    Err(bad())
                } else {
                    p.parse::<u32>().map_err(|_| bad())
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        if parts.len() > 4 {
            return Err(bad());
        }
        Ok(Version {
            parts,
            text: s.to_string(),
        })
    }
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(other.key())
    }
}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl std::hash::Hash for Version {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Checks a user-supplied `--min-version` against DeepEP's floor.
pub fn check_min_version(v: &Version) -> Result<(), Error> {
    if *v < Version::deepep_min() {
        return Err(Error::MinVersionTooOld(v.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Version {
        s.parse().unwrap()
    }

    #[test]
    fn numeric_not_lexical() {
        assert!(v("3.3.9") < v("3.3.20"));
        assert!(v("3.3.24") < v("3.4.5"));
        assert!(v("3.10.0") > v("3.9.9"));
        assert_eq!(v("3.4.5"), v("3.4.5.0"));
    }

    #[test]
    fn rejects_non_release_versions() {
        for bad in [
            "",
            "0.0.0a0",
            "3..4",
            "3.4.5.post1",
            "v3.4.5",
            "03.4",
            "1.2.3.4.5",
            "3.4.99999999999",
        ] {
            assert!(bad.parse::<Version>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn min_version_floor() {
        assert!(check_min_version(&v("3.3.9")).is_ok());
        assert!(check_min_version(&v("3.4.5")).is_ok());
        let err = check_min_version(&v("3.2.5")).unwrap_err().to_string();
        assert!(err.contains("DeepEP") && err.contains("3.3.9"), "{err}");
    }
}
