//! Ctrl-C while a model is fetched ([`while_loading`]) and in interactive use. While a reply is
//! being generated ([`Replying`] alive), SIGINT asks it to stop: the chat loop sees [`requested`] and cancels the generation through its
//! `CancelHandle`, and the session goes on. With no reply running (at the prompt), or at a second
//! Ctrl-C before the reply has stopped, the process ends (status 0 at the prompt, 130 otherwise).

use std::sync::atomic::{AtomicBool, Ordering};

static REPLYING: AtomicBool = AtomicBool::new(false);
static REQUESTED: AtomicBool = AtomicBool::new(false);

/// The SIGINT handler: only atomics, `write` and `_exit` (async-signal-safe).
extern "C" fn on_sigint(_: libc::c_int) {
    if REPLYING.load(Ordering::SeqCst) {
        if !REQUESTED.swap(true, Ordering::SeqCst) {
            return;
        }
        exit_now(130);
    }
    exit_now(0);
}

fn exit_now(status: libc::c_int) -> ! {
    let newline = b"\n";
    // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffer outlives the call.
    unsafe {
        libc::write(2, newline.as_ptr().cast(), 1);
        libc::_exit(status)
    }
}

/// While a model is fetched: the first Ctrl-C stops the download, which removes its partial
/// files and fails with an error; with no download running, or at a second Ctrl-C, the process
/// ends (status 130).
extern "C" fn on_sigint_loading(_: libc::c_int) {
    if rmlx_lm::registry::downloads_active() && !REQUESTED.swap(true, Ordering::SeqCst) {
        rmlx_lm::registry::interrupt_downloads();
        return;
    }
    exit_now(130);
}

fn set_handler(handler: libc::sighandler_t) -> std::io::Result<()> {
    // SAFETY: the sigaction struct is zero-initialised then filled; the handlers only touch
    // atomics and async-signal-safe calls.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Installs the chat's SIGINT handler (restarting interrupted system calls).
pub fn install() -> std::io::Result<()> {
    set_handler(on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t)
}

/// Ignores SIGINT from now on: a rank that follows rank 0 (which alone answers Ctrl-C) under
/// `rmlx launch`, where a terminal's Ctrl-C reaches every rank.
pub fn ignore() -> std::io::Result<()> {
    set_handler(libc::SIG_IGN)
}

/// Runs `load` with Ctrl-C stopping downloads cleanly (see [`on_sigint_loading`]), then puts the
/// default SIGINT disposition back.
pub fn while_loading<T>(load: impl FnOnce() -> T) -> std::io::Result<T> {
    set_handler(on_sigint_loading as extern "C" fn(libc::c_int) as libc::sighandler_t)?;
    let out = load();
    set_handler(libc::SIG_DFL)?;
    REQUESTED.store(false, Ordering::SeqCst);
    Ok(out)
}

/// Marks a reply as running until dropped: Ctrl-C then stops the reply instead of the process.
pub struct Replying(());

impl Replying {
    pub fn start() -> Self {
        REQUESTED.store(false, Ordering::SeqCst);
        REPLYING.store(true, Ordering::SeqCst);
        Replying(())
    }
}

impl Drop for Replying {
    fn drop(&mut self) {
        REPLYING.store(false, Ordering::SeqCst);
        REQUESTED.store(false, Ordering::SeqCst);
    }
}

/// Whether Ctrl-C was pressed during the current reply.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
