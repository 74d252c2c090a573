//! A running `rmlx serve` and a plain HTTP/1.1 client over TCP, for the server's tests.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");
pub const MODEL: &str = "SmolLM2-135M-Instruct";

/// A running server; killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        Self::start_as(&[], extra)
    }

    /// A server whose model is split over `ranks` processes (`rmlx launch` over the ring).
    pub fn launch(ranks: usize, extra: &[&str]) -> Server {
        Self::start_as(&["launch", "-n", &ranks.to_string(), "--backend", "ring", "--"], extra)
    }

    fn start_as(launch: &[&str], extra: &[&str]) -> Server {
        let mut child = Command::new(RMLX)
            .args(launch)
            .args(["serve", "--port", "0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("the server exited before listening").unwrap();
            if let Some(at) = line.find(" on http://") {
                break line[at + " on http://".len()..].trim().to_string();
            }
        };
        // Keep draining stderr so that the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }

    /// `(status, body)` of one request.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>, headers: &[(&str, &str)]) -> (u16, String) {
        request(&self.addr, method, path, body, headers)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post(&self.addr, path, body)
    }
}

/// `(status, body)` of one HTTP/1.1 request to `addr`.
pub fn request(addr: &str, method: &str, path: &str, body: Option<&Value>, headers: &[(&str, &str)]) -> (u16, String) {
    let (head, body) = exchange(addr, method, path, &body.map(|b| b.to_string()).unwrap_or_default(), headers);
    (head.split(' ').nth(1).unwrap().parse().unwrap(), body)
}

/// The response head and (de-chunked) body of one HTTP/1.1 request with a raw `body` (JSON or not).
pub fn exchange(addr: &str, method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> (String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    stream.write_all(format!("{head}\r\n{body}").as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    (head.to_string(), if chunked { dechunk(body) } else { body.to_string() })
}

/// A JSON POST: `(status, JSON body)`.
pub fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = request(addr, "POST", path, Some(body), &[]);
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of a chunked transfer.
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
}
