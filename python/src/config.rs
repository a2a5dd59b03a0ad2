//! `Config`: DeepEP v1.2.1's native `deep_ep.Config` (csrc/config.hpp, bound in csrc/deep_ep.cpp),
//! with the same constructor (defaults 20, 6, 256, 6, 256) and the two size hints. The checks
//! are the kernels crate's ([`DeepEpConfig::new`]); the hints size OUR buffers: the NVLink buffer
//! for `DEEPEP_KERNELS_MAX_TOKENS` tokens per rank (our kernels receive every row at its final
//! place, where DeepEP streams through a ring buffer of the chunk sizes) and the internode
//! symmetric buffer for up to 32 top-k and 128 experts per rank.

use deepep_kernels::config::{buffer_size_hint, DeepEpConfig};
use deepep_kernels::error::EpError;
use deepep_kernels::internode::plan::MAX_TOPK;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

/// Tokens per rank the hints size the buffers for (`DEEPEP_KERNELS_MAX_TOKENS`, default 4096).
pub(crate) const DEFAULT_MAX_TOKENS_ENV: &str = "DEEPEP_KERNELS_MAX_TOKENS";
pub(crate) const DEFAULT_MAX_TOKENS: usize = 4096;
/// DeepEP's NUM_MAX_NVL_PEERS: GPUs per host the hints assume.
pub(crate) const NUM_MAX_NVL_PEERS: usize = 8;
/// Experts per rank the internode hint sizes for.
pub(crate) const INTERNODE_HINT_LOCAL_EXPERTS: usize = 128;
/// No GPU holds 1 TiB: a larger hint comes from arguments that cannot be meant and is refused.
pub(crate) const MAX_HINT_BYTES: usize = 1 << 40;

/// `v` as an int argument (not a bool): `Some(value)`, or None when it is past 64 bits.
fn int_arg(fn_name: &str, name: &str, v: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if !v.is_instance_of::<PyInt>() || v.is_instance_of::<PyBool>() {
        let t = v.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!("{fn_name}: {name} must be an int, got {t} {}", v.repr()?)));
    }
    Ok(v.extract::<i64>().ok())
}

/// A count argument of a hint: an int >= 1 (None: past 64 bits, sized as "more than 2^64").
fn count_arg(fn_name: &str, name: &str, v: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    match int_arg(fn_name, name, v)? {
        Some(n) if n < 1 => Err(PyValueError::new_err(format!("{fn_name}: {name}={n} must be >= 1"))),
        Some(n) => Ok(Some(n as usize)),
        None if v.lt(0)? => Err(PyValueError::new_err(format!("{fn_name}: {name}={} must be >= 1", v.str()?))),
        None => Ok(None),
    }
}

/// `DEEPEP_KERNELS_MAX_TOKENS` (unset or empty: 4096), a positive token count.
pub(crate) fn default_max_tokens() -> PyResult<usize> {
    max_tokens_from(std::env::var(DEFAULT_MAX_TOKENS_ENV).ok().as_deref()).map_err(PyValueError::new_err)
}

fn max_tokens_from(v: Option<&str>) -> Result<usize, String> {
    match v {
        None | Some("") => Ok(DEFAULT_MAX_TOKENS),
        Some(s) => match s.trim().parse::<i64>() {
            Ok(n) if n >= 1 => Ok(n as usize),
            _ => Err(format!("{DEFAULT_MAX_TOKENS_ENV}='{s}' must be a positive token count (tokens per rank per dispatch)")),
        },
    }
}

/// The byte count `compute` gives (None: an input past 64 bits), refused naming the inputs
/// (`what`) above [`MAX_HINT_BYTES`]; other refusals of the sizing pass on, said by the hint.
fn sized(fn_name: &str, what: &str, compute: Option<deepep_kernels::Result<usize>>) -> PyResult<usize> {
    sized_msg(fn_name, what, compute).map_err(PyValueError::new_err)
}

fn sized_msg(fn_name: &str, what: &str, compute: Option<deepep_kernels::Result<usize>>) -> Result<usize, String> {
    let shown = match compute {
        None => "more than 2^64 bytes".to_string(),
        Some(Ok(n)) if n <= MAX_HINT_BYTES => return Ok(n),
        Some(Ok(n)) => format!("{:.1} TiB", n as f64 / (1u64 << 40) as f64),
        Some(Err(EpError::InvalidArgument(m))) if m.contains("exceed 1 TiB") => "more than 1 TiB".to_string(),
        Some(Err(e)) => {
            let m = match e {
                EpError::InvalidArgument(m) => m,
                other => other.to_string(),
            };
            let note = if m.contains("max_tokens_per_rank") { format!(" (the hints take max_tokens_per_rank from {DEFAULT_MAX_TOKENS_ENV})") } else { String::new() };
            return Err(format!("{fn_name}: {m}{note}"));
        }
    };
    Err(format!(
        "{fn_name}: {what} needs {shown} of buffer, more than any GPU holds (the hint refuses above 1 TiB); lower them \
         ({DEFAULT_MAX_TOKENS_ENV} is the tokens per rank and dispatch)"
    ))
}

/// DeepEP's `Config(num_sms=20, num_max_nvl_chunked_send_tokens=6,
/// num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
/// num_max_rdma_chunked_recv_tokens=256)`.
///
/// `num_sms` sets the thread blocks of our intranode dispatch/combine kernels (and of the
/// internode ones, which need it even: `num_sms / 2` channels). The four chunk sizes are DeepEP
/// ring-buffer knobs; they are checked as DeepEP checks them and kept as read-only attributes, but
/// our kernels have no ring buffer and never read them (they never change results).
#[pyclass(module = "deepep_kernels._native", frozen)]
pub(crate) struct Config {
    pub(crate) inner: DeepEpConfig,
}

#[pymethods]
impl Config {
    #[new]
    #[pyo3(signature = (num_sms = None, num_max_nvl_chunked_send_tokens = None, num_max_nvl_chunked_recv_tokens = None,
                        num_max_rdma_chunked_send_tokens = None, num_max_rdma_chunked_recv_tokens = None))]
    fn new(
        num_sms: Option<&Bound<'_, PyAny>>,
        num_max_nvl_chunked_send_tokens: Option<&Bound<'_, PyAny>>,
        num_max_nvl_chunked_recv_tokens: Option<&Bound<'_, PyAny>>,
        num_max_rdma_chunked_send_tokens: Option<&Bound<'_, PyAny>>,
        num_max_rdma_chunked_recv_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Config> {
        let given = [num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens];
        let defaults = [20i64, 6, 256, 6, 256];
        let mut v = defaults;
        for (i, g) in given.iter().enumerate() {
            if let Some(g) = g {
                let name = DeepEpConfig::FIELDS[i];
                // a value past 64 bits is out of every range below: shown as given
                v[i] = int_arg("Config", name, g)?.ok_or_else(|| PyValueError::new_err(format!("Config: {name}={} is out of range", g.str().map(|s| s.to_string()).unwrap_or_default())))?;
            }
        }
        DeepEpConfig::new(v).map(|inner| Config { inner }).map_err(crate::py_err)
    }

    #[getter]
    fn num_sms(&self) -> usize {
        self.inner.num_sms
    }
    #[getter]
    fn num_max_nvl_chunked_send_tokens(&self) -> usize {
        self.inner.num_max_nvl_chunked_send_tokens
    }
    #[getter]
    fn num_max_nvl_chunked_recv_tokens(&self) -> usize {
        self.inner.num_max_nvl_chunked_recv_tokens
    }
    #[getter]
    fn num_max_rdma_chunked_send_tokens(&self) -> usize {
        self.inner.num_max_rdma_chunked_send_tokens
    }
    #[getter]
    fn num_max_rdma_chunked_recv_tokens(&self) -> usize {
        self.inner.num_max_rdma_chunked_recv_tokens
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "Config(num_sms={}, nvl=({}, {}), rdma=({}, {}))",
            c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens, c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens
        )
    }

    /// Bytes of the NVLink buffer for rows of `hidden_bytes` (bf16: 2 bytes per channel) and
    /// `DEEPEP_KERNELS_MAX_TOKENS` (default 4096) tokens per rank and dispatch, on `num_ranks`
    /// ranks (below 8 or a multiple of 8, as in DeepEP).
    fn get_nvl_buffer_size_hint(&self, hidden_bytes: &Bound<'_, PyAny>, num_ranks: &Bound<'_, PyAny>) -> PyResult<usize> {
        let f = "get_nvl_buffer_size_hint";
        let hb = count_arg(f, "hidden_bytes", hidden_bytes)?;
        let r = count_arg(f, "num_ranks", num_ranks)?;
        if let Some(r) = r {
            if r >= NUM_MAX_NVL_PEERS && r % NUM_MAX_NVL_PEERS != 0 {
                return Err(PyValueError::new_err(format!(
                    "{f}: num_ranks={r} must be below {NUM_MAX_NVL_PEERS} or a multiple of it (hosts of {NUM_MAX_NVL_PEERS} GPUs), as in DeepEP"
                )));
            }
        }
        let tokens = default_max_tokens()?;
        let what = format!("hidden_bytes={}, num_ranks={} and {tokens} tokens per rank", hidden_bytes.str()?, num_ranks.str()?);
        let compute = match (hb, r) {
            (Some(hb), Some(r)) => Some(buffer_size_hint(r, tokens, hb.div_ceil(2))),
            _ => None,
        };
        sized(f, &what, compute)
    }

    /// Bytes of the internode (RDMA) symmetric buffer for rows of `hidden_bytes` (bf16: 2 bytes
    /// per channel), `num_ranks` ranks in hosts of 8 GPUs (DeepEP's NUM_MAX_NVL_PEERS; or
    /// `DEEPEP_KERNELS_RANKS_PER_HOST`), this config's `num_sms` and `DEEPEP_KERNELS_MAX_TOKENS`
    /// (default 4096) tokens per rank and dispatch, for up to 32 top-k and 128 experts per rank.
    /// 0 when the ranks fit in one host, like DeepEP.
    fn get_rdma_buffer_size_hint(&self, hidden_bytes: &Bound<'_, PyAny>, num_ranks: &Bound<'_, PyAny>) -> PyResult<usize> {
        let f = "get_rdma_buffer_size_hint";
        let hb = count_arg(f, "hidden_bytes", hidden_bytes)?;
        let r = count_arg(f, "num_ranks", num_ranks)?;
        let what = |tokens: usize| -> PyResult<String> { Ok(format!("hidden_bytes={}, num_ranks={} and {tokens} tokens per rank", hidden_bytes.str()?, num_ranks.str()?)) };
        let Some(r) = r else {
            let tokens = default_max_tokens()?;
            return sized(f, &what(tokens)?, None);
        };
        let rph = crate::settings::ranks_per_host_from_env(r, None)?.unwrap_or(NUM_MAX_NVL_PEERS);
        if r <= rph {
            return Ok(0);
        }
        if r % rph != 0 {
            return Err(PyValueError::new_err(format!(
                "{f}: {r} ranks do not form hosts of {rph} GPUs; use a multiple of {rph} ranks (or set DEEPEP_KERNELS_RANKS_PER_HOST to the GPUs per host)"
            )));
        }
        let sms = self.inner.num_sms;
        if sms < 2 || sms % 2 != 0 {
            return Err(PyValueError::new_err(format!("{f}: the internode mode needs an even num_sms >= 2, this Config has {sms}")));
        }
        let tokens = default_max_tokens()?;
        let compute = hb.map(|hb| {
            let hidden = hb.div_ceil(2).div_ceil(128) * 128; // the internode rows are multiples of 128 channels
            deepep_kernels::context::inter_bytes(r, (rph, tokens, hidden, sms.min(64), MAX_TOPK, INTERNODE_HINT_LOCAL_EXPERTS))
        });
        sized(f, &what(tokens)?, compute)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_setting_is_a_positive_count() {
        assert_eq!(max_tokens_from(None), Ok(4096));
        assert_eq!(max_tokens_from(Some("")), Ok(4096));
        assert_eq!(max_tokens_from(Some("8192")), Ok(8192));
        for bad in ["0", "-3", "lots"] {
            let e = max_tokens_from(Some(bad)).unwrap_err();
            assert!(e.contains(&format!("DEEPEP_KERNELS_MAX_TOKENS='{bad}' must be a positive token count")), "{e}");
        }
    }

    #[test]
    fn hints_refuse_absurd_sizes_and_pass_the_kernels_refusals_on() {
        let e = sized_msg("h", "x", Some(Ok(MAX_HINT_BYTES + 1))).unwrap_err();
        assert!(e.contains("h: x needs 1.0 TiB of buffer"), "{e}");
        let e = sized_msg("h", "x", None).unwrap_err();
        assert!(e.contains("more than 2^64 bytes"), "{e}");
        let e = sized_msg("h", "x", Some(Err(EpError::InvalidArgument("max_tokens_per_rank is 0".into())))).unwrap_err();
        assert!(e.ends_with("h: max_tokens_per_rank is 0 (the hints take max_tokens_per_rank from DEEPEP_KERNELS_MAX_TOKENS)"), "{e}");
        assert_eq!(sized_msg("h", "x", Some(Ok(1024))), Ok(1024));
    }
}
