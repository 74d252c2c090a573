//! `rmlx serve --prompt-cache-dir`: the prompt cache written to the directory at shutdown is
//! found by the next server over it, whose first request reuses it (every prompt token but the
//! last, the same reply; `/metrics` counts the directory's files and bytes); a directory budget
//! without a directory is refused.

mod support;

use serde_json::json;
use std::process::{Command, Stdio};
use std::time::Duration;
use support::{Server, RMLX};

/// Stops a server with SIGTERM and waits for its clean exit.
fn stop(mut server: Server) {
    // SAFETY: kill(2) on the child's pid, which has not been waited for yet.
    assert_eq!(unsafe { libc::kill(server.child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "still running after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));
}

#[test]
fn the_prompt_cache_outlives_the_server() {
    let dir = std::env::temp_dir().join(format!("rmlx-serve-prompt-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let flags = ["--prompt-cache-dir", dir.to_str().unwrap(), "--warm-up", "off"];
    let chat = json!({"messages": [{"role": "system", "content": "You are a terse assistant."},
                                   {"role": "user", "content": "Name a colour."}],
                      "max_tokens": 6, "temperature": 0});
    let server = Server::start(&flags);
    let (status, first) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    stop(server);
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files.len(), 1, "one entry written at shutdown: {files:?}");
    let server = Server::start(&flags);
    let (_, metrics) = server.request("GET", "/metrics", None, &[]);
    let bytes = std::fs::metadata(dir.join(&files[0])).unwrap().len();
    assert!(metrics.contains("rmlx_prompt_cache_disk_files 1\n"), "{metrics}");
    assert!(metrics.contains(&format!("rmlx_prompt_cache_disk_bytes {bytes}\n")), "{metrics}");
    let (status, again) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{again}");
    let prompt_tokens = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(prompt_tokens - 1));
    assert_eq!(again["choices"][0]["message"], first["choices"][0]["message"]);
    stop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_budget_needs_a_directory() {
    let out = Command::new(RMLX).args(["serve", "--prompt-cache-dir-gb", "1"]).stdin(Stdio::null()).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--prompt-cache-dir"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
