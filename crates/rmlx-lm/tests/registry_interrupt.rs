//! `registry::interrupt_downloads` (what the CLI's Ctrl-C handler calls) stops a running download,
//! which removes its temporary file. Alone in its test binary: the flag is process-wide and stays set.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use rmlx_lm::registry::{self, Artifact};
use rmlx_lm::Error;

/// A server that announces 100 MB and trickles them out in 64 KiB blocks.
fn slow_server() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/model.bin", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\nConnection: close\r\n\r\n");
                let block = vec![1u8; 1 << 16];
                while s.write_all(&block).is_ok() {
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
        }
    });
    url
}

#[test]
fn interrupted_download_removes_its_files() {
    let dir = std::env::temp_dir().join(format!("rmlx-registry-interrupt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let url = slow_server();
    let artifact = Artifact { url: url.clone().into(), sha256: "00".repeat(32).into(), size: 100_000_000 };
    assert!(!registry::downloads_active());
    let dest = dir.join("model.bin");
    let worker = std::thread::spawn(move || registry::download(&artifact, &dest));
    // Wait until the partial file holds data, then interrupt.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let partial = std::fs::read_dir(&dir).unwrap().flatten().any(|e| e.metadata().unwrap().len() > 0);
        if partial {
            break;
        }
        assert!(Instant::now() < deadline, "the download never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(registry::downloads_active());
    registry::interrupt_downloads();
    let err = worker.join().unwrap().unwrap_err();
    assert!(matches!(&err, Error::Download { url: u, reason } if *u == url && reason == "interrupted"), "{err}");
    assert!(!registry::downloads_active());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "partial files left");
    std::fs::remove_dir_all(&dir).unwrap();
}
