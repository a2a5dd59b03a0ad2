//! HTTP with timeouts, retries with exponential backoff, size limits, and resumable
//! downloads (HTTP `Range` into a `.part` file; restarts when the server ignores `Range`).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use reqwest::blocking::{Client, Response};
use reqwest::header::{CONTENT_RANGE, RANGE};
use reqwest::StatusCode;

use crate::error::{Error, Result};

/// Network behaviour; the defaults suit NVIDIA's and PyPI's hosts.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Connect timeout, and the longest wait for headers or for the next body bytes.
    pub timeout: Duration,
    /// Attempts per request (1 = no retry).
    pub attempts: u32,
    /// First backoff delay; doubled after each failed attempt.
    pub backoff: Duration,
    /// Show a progress bar on stderr for downloads (hidden anyway when stderr is no TTY).
    pub progress: bool,
    /// What to do about a 4xx answer, in the caller's terms (its flags).
    pub not_found_hint: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            timeout: Duration::from_secs(30),
            attempts: 4,
            backoff: Duration::from_millis(500),
            progress: true,
            not_found_hint: "check the URL".to_string(),
        }
    }
}

/// Outcome of one attempt: retry or give up.
enum Attempt {
    Retry(String),
    Fatal(Error),
}

/// A configured HTTP client.
pub struct Http {
    client: Client,
    cfg: HttpConfig,
}

impl Http {
    pub fn new(cfg: HttpConfig) -> Result<Http> {
        let mut builder = Client::builder();
        for cert in extra_roots() {
            builder = builder.add_root_certificate(cert);
        }
        let client = builder
            .connect_timeout(cfg.timeout)
            .timeout(cfg.timeout)
            .user_agent(concat!("deepep-nix/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Http {
                url: String::new(),
                msg: format!("cannot create the HTTP client: {e}"),
            })?;
        Ok(Http { client, cfg })
    }

    /// Runs `attempt` up to `cfg.attempts` times with exponential backoff between tries.
    fn with_retries<T>(
        &self,
        url: &str,
        mut attempt: impl FnMut() -> std::result::Result<T, Attempt>,
    ) -> Result<T> {
        let mut delay = self.cfg.backoff;
        let mut last = String::new();
        for n in 1..=self.cfg.attempts.max(1) {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(msg)) => {
                    last = msg;
                    if n < self.cfg.attempts {
                        tracing::warn!(
                            "GET {url}: {last}; retrying in {delay:?} (attempt {}/{})",
                            n + 1,
                            self.cfg.attempts
                        );
                        std::thread::sleep(delay);
                        delay = delay.saturating_mul(2);
                    }
                }
            }
        }
        Err(Error::Http {
            url: url.to_string(),
            msg: format!(
                "{last} (gave up after {} attempts; check the network and the URL, or raise --retries / --timeout)",
                self.cfg.attempts
            ),
        })
    }

    /// Sends a GET; classifies transport errors and statuses into retry / fatal.
    fn send(&self, url: &str, range_from: u64) -> std::result::Result<Response, Attempt> {
        let mut req = self.client.get(url);
        if range_from > 0 {
            req = req.header(RANGE, format!("bytes={range_from}-"));
        }
        let resp = req.send().map_err(|e| Attempt::Retry(describe(e)))?;
        let status = resp.status();
        if status.is_success() || status == StatusCode::RANGE_NOT_SATISFIABLE {
            Ok(resp)
        } else if status.is_server_error()
            || status == StatusCode::TOO_MANY_REQUESTS
            || status == StatusCode::REQUEST_TIMEOUT
        {
            Err(Attempt::Retry(format!("server answered {status}")))
        } else {
            Err(Attempt::Fatal(Error::Http {
                url: url.to_string(),
                msg: format!("server answered {status}; {}", self.cfg.not_found_hint),
            }))
        }
    }

    /// GETs a document of at most `limit` bytes into memory. A body shorter than its
    /// `Content-Length` (connection dropped) is retried.
    pub fn get_bytes(&self, url: &str, limit: usize) -> Result<Vec<u8>> {
        self.with_retries(url, || {
            let resp = self.send(url, 0)?;
            if resp.status() == StatusCode::RANGE_NOT_SATISFIABLE {
                return Err(Attempt::Fatal(Error::Http {
                    url: url.into(),
                    msg: "server answered 416 to a plain GET".into(),
                }));
            }
            let declared = resp.content_length();
            if declared.is_some_and(|n| n > limit as u64) {
                return Err(Attempt::Fatal(Error::Http {
                    url: url.into(),
                    msg: format!(
                        "document is {} bytes, over the {limit} bytes limit for metadata",
                        declared.unwrap_or(0)
                    ),
                }));
            }
            let mut body = Vec::new();
            resp.take(limit as u64 + 1)
                .read_to_end(&mut body)
                .map_err(|e| {
                    Attempt::Retry(format!(
                        "body read failed after {} bytes: {}",
                        body.len(),
                        self.read_error(&e)
                    ))
                })?;
            if body.len() > limit {
                return Err(Attempt::Fatal(Error::Http {
                    url: url.into(),
                    msg: format!("document exceeds the {limit} bytes limit for metadata"),
                }));
            }
            if let Some(n) = declared {
                if n != body.len() as u64 {
                    return Err(Attempt::Retry(format!(
                        "truncated body: {} of {n} bytes",
                        body.len()
                    )));
                }
            }
            Ok(body)
        })
    }

    /// Downloads `url` into `part` (a `.part` file), resuming from its current length with
    /// `Range` and starting over when the server ignores `Range`. `expected_size`, when
    /// known, bounds the download and sizes the progress bar. Returns the final length.
    pub fn download(&self, url: &str, part: &Path, expected_size: Option<u64>) -> Result<u64> {
        let bar = self.progress_bar(part, expected_size);
        let result = self.with_retries(url, || {
            let have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
            if expected_size.is_some_and(|n| have == n) {
                return Ok(have); // a previous run already fetched everything
            }
            let resp = self.send(url, have)?;
            let status = resp.status();
            let (mut file, start) = if status == StatusCode::PARTIAL_CONTENT && have > 0 {
                let from = resp
                    .headers()
                    .get(CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split('-').next())
                    .and_then(|v| v.parse::<u64>().ok());
                if from != Some(have) {
                    truncate(part).map_err(Attempt::Fatal)?;
                    return Err(Attempt::Retry(format!(
                        "server resumed at {from:?} instead of byte {have}; restarting"
                    )));
                }
                (open_append(part).map_err(Attempt::Fatal)?, have)
            } else if status == StatusCode::RANGE_NOT_SATISFIABLE {
                truncate(part).map_err(Attempt::Fatal)?;
                return Err(Attempt::Retry(
                    "server refused to resume (416); restarting from byte 0".into(),
                ));
            } else {
                if have > 0 {
                    tracing::info!("{url}: server ignored Range; restarting from byte 0");
                }
                (
                    File::create(part).map_err(|e| Attempt::Fatal(Error::io(part, e)))?,
                    0,
                )
            };
            let declared_total = resp.content_length().map(|n| n + start);
            bar.set_position(start);
            let mut resp = resp;
            let mut buf = vec![0u8; 1 << 16];
            let mut pos = start;
            loop {
                let n = match resp.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        file.flush().ok();
                        return Err(Attempt::Retry(format!(
                            "download interrupted at byte {pos}: {}",
                            self.read_error(&e)
                        )));
                    }
                };
                file.write_all(&buf[..n])
                    .map_err(|e| Attempt::Fatal(Error::io(part, e)))?;
                pos += n as u64;
                bar.set_position(pos);
                if let Some(max) = expected_size.filter(|max| pos > *max) {
                    drop(file);
                    let disposition = match std::fs::remove_file(part) {
                        Ok(()) => "the file was deleted".to_string(),
                        Err(e) => format!("deleting the file failed ({e}); delete it by hand"),
                    };
                    return Err(Attempt::Fatal(Error::Verify {
                        file: part.to_path_buf(),
                        what: "size",
                        expected: format!("{max} bytes"),
                        actual: format!("more than {max} bytes from {url}"),
                        disposition,
                    }));
                }
            }
            file.sync_all()
                .map_err(|e| Attempt::Fatal(Error::io(part, e)))?;
            if declared_total.is_some_and(|n| n != pos) {
                return Err(Attempt::Retry(format!(
                    "truncated body: {pos} of {} bytes",
                    declared_total.unwrap_or(0)
                )));
            }
            Ok(pos)
        });
        bar.finish_and_clear();
        result
    }

    /// A body read error. reqwest reports a read that waited longer than the timeout as a
    /// "decoding" error whose cause is the timeout; it is named as the timeout it is.
    fn read_error(&self, e: &std::io::Error) -> String {
        let mut timed_out = e.kind() == std::io::ErrorKind::TimedOut;
        let mut src: Option<&(dyn std::error::Error + 'static)> =
            e.get_ref().map(|r| r as &(dyn std::error::Error + 'static));
        while let Some(s) = src {
            if s.downcast_ref::<reqwest::Error>()
                .is_some_and(reqwest::Error::is_timeout)
                || s.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
            {
                timed_out = true;
            }
            src = s.source();
        }
        if timed_out {
            format!(
                "timed out: no body bytes for {} s (--timeout)",
                self.cfg.timeout.as_secs()
            )
        } else {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(s) = src {
                let t = s.to_string();
                if !msg.contains(&t) {
                    msg = format!("{msg}: {t}");
                }
                src = s.source();
            }
            msg
        }
    }

    fn progress_bar(&self, part: &Path, len: Option<u64>) -> ProgressBar {
        if !self.cfg.progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template(
            "{msg} {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        let name = part
            .file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".part").to_string())
            .unwrap_or_default();
        bar.set_message(name);
        bar
    }
}

/// CA certificates from `SSL_CERT_FILE` (a PEM bundle), trusted in addition to the built-in
/// web PKI roots, as curl and OpenSSL do; needed behind TLS-inspecting proxies.
fn extra_roots() -> Vec<reqwest::Certificate> {
    let Some(path) = std::env::var_os("SSL_CERT_FILE") else {
        return Vec::new();
    };
    match std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|pem| reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| e.to_string()))
    {
        Ok(certs) => certs,
        Err(e) => {
            tracing::warn!("ignoring SSL_CERT_FILE={}: {e}", Path::new(&path).display());
            Vec::new()
        }
    }
}

fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| Error::io(path, e))
}

fn truncate(path: &Path) -> Result<()> {
    File::create(path).map(drop).map_err(|e| Error::io(path, e))
}

/// A transport error with its cause chain (reqwest hides the useful part in `source`),
/// without repeating the URL the caller already names.
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut msg = if e.is_timeout() {
        "timed out".to_string()
    } else {
        e.to_string()
    };
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    msg
}
