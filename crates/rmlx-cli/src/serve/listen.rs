//! The server's connections, with the limits a public endpoint needs: at most `max_connections`
//! at once (more are closed as they arrive, so established clients keep being served), request
//! headers within `header_timeout` and bodies within `body_timeout` (a client sending a byte a
//! second, or a `Content-Length` longer than its body, is cut off with 408), and a shutdown that
//! drains: the first Ctrl-C or SIGTERM stops accepting and lets running requests finish for
//! `drain_timeout`, after which the streams still open end with an error event; a second signal
//! exits at once.

use super::api::ApiError;
use super::error;
use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// The limits of [`serve`].
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub drain_timeout: Duration,
}

/// Middleware: reads the whole body within `limits.body_timeout` (408 past it) and at most
/// `max_body` bytes (413), before the handler parses it.
pub async fn read_body(timeout: Duration, max_body: usize, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, max_body)).await {
        Err(_) => {
            let message = format!("the request body did not arrive within {} s", timeout.as_secs());
            error(ApiError { status: 408, message, param: None })
        }
        Ok(Err(_)) => {
            let message = format!("the request body is larger than {} MiB", max_body >> 20);
            error(ApiError { status: 413, message, param: None })
        }
        Ok(Ok(bytes)) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
    }
}

/// Serves `router` on `listener` until the first shutdown signal, then drains (see the module
/// doc). `cut` turns true when the drain deadline passes: the handlers end what they still send.
pub async fn serve(listener: TcpListener, router: Router, limits: Limits, cut: watch::Sender<bool>) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (closing, _) = watch::channel(false);
    // Listening from the start: a second signal that comes while the first is being handled is
    // not lost.
    let mut signals = Signals::new();
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors, say: wait for connections to close.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = signals.next() => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(limit = limits.max_connections, "connection limit reached: closing a new connection");
            continue;
        };
        let service =
            TowerToHyperService::new(router.clone().map_request(|r: Request<hyper::body::Incoming>| r.map(Body::new)));
        let mut closing = closing.subscribe();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            loop {
                tokio::select! {
                    _ = connection.as_mut() => break,
                    _ = closing.changed() => connection.as_mut().graceful_shutdown(),
                }
            }
            drop(permit);
        });
    }
    eprintln!(
        "shutting down: finishing the requests in progress (at most {} s; a second signal exits now)",
        limits.drain_timeout.as_secs()
    );
    let _ = closing.send(true);
    tokio::spawn(async move {
        signals.next().await;
        eprintln!("second signal: exiting now");
        exit_now(130);
    });
    let all = limits.max_connections as u32;
    let drained = tokio::time::timeout(limits.drain_timeout, permits.acquire_many(all)).await;
    if drained.is_err() {
        let open = limits.max_connections - permits.available_permits();
        eprintln!("drain deadline passed: ending {open} connection(s) with an error");
        let _ = cut.send(true);
        if tokio::time::timeout(Duration::from_secs(5), permits.acquire_many(all)).await.is_err() {
            exit_now(1);
        }
    }
}

/// Ends the process at once, without running exit handlers or static destructors: the generation
/// loop may be inside MLX on another thread, and tearing MLX down under it crashes the process.
fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stderr().flush();
    // SAFETY: _exit(2) ends the process; nothing in it returns or unwinds.
    unsafe { libc::_exit(code) }
}

/// Ctrl-C and SIGTERM (how service managers stop a server), each signal counted once.
struct Signals {
    #[cfg(unix)]
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    fn new() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let streams = signal(SignalKind::terminate()).ok().zip(signal(SignalKind::interrupt()).ok());
            Signals { streams }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn next(&mut self) {
        #[cfg(unix)]
        if let Some((term, int)) = &mut self.streams {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}
