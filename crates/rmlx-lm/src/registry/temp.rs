//! Files under construction: [`TempPath`] (a unique temporary name beside the final path, removed
//! unless persisted), the sweep of those left by killed processes, and the interruption of running
//! downloads (Ctrl-C), which then clean up after themselves.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::marker_path;
use crate::{Error, Result};

/// Set by [`interrupt_downloads`]; checked between blocks of every download and extraction.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// [`TempPath`]s alive: files being downloaded, extracted or unpacked.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// Makes every download and extraction of this process stop at its next block with an
/// [`Error::Download`] whose reason is `interrupted`, removing its temporary files as it unwinds;
/// later ones fail the same way (the flag stays set). Async-signal-safe (one atomic store): a
/// SIGINT handler may call it.
pub fn interrupt_downloads() {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Whether a download, extraction or unpacking is under way in this process (a temporary file
/// exists). Async-signal-safe (one atomic load).
pub fn downloads_active() -> bool {
    ACTIVE.load(Ordering::SeqCst) > 0
}

/// An [`Error::Download`] for `what` once [`interrupt_downloads`] was called.
pub(super) fn check_interrupted(what: &str) -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err(Error::Download { url: what.to_string(), reason: "interrupted".into() });
    }
    Ok(())
}

/// A path under construction, removed on drop unless [`TempPath::persist`]ed. The name is unique
/// to the process and the call: `.<name>.<pid>.<counter>.tmp` beside the final path.
pub(super) struct TempPath(Option<PathBuf>);

impl TempPath {
    pub(super) fn beside(dest: &Path) -> Result<Self> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        create_parent(dest)?;
        if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
            remove_stale_temp_files(dir);
        }
        let name = dest.file_name().unwrap_or_default().to_string_lossy();
        let unique = format!(".{name}.{}.{}.tmp", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        Ok(TempPath(Some(dest.with_file_name(unique))))
    }

    pub(super) fn path(&self) -> &Path {
        self.0.as_deref().expect("a TempPath is only emptied by persist")
    }

    /// Renames the file to `dest` (replacing any file there).
    pub(super) fn persist(mut self, dest: &Path) -> Result<()> {
        let tmp = self.0.take().expect("persisted once");
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
        fs::rename(&tmp, dest).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::io(dest, e)
        })
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
            if path.is_dir() {
                let _ = fs::remove_dir_all(&path);
            } else {
                let _ = fs::remove_file(&path);
                let _ = fs::remove_file(marker_path(&path));
            }
        }
    }
}

/// Removes the temporary files and directories in `dir` (`.<name>.<pid>.<n>.tmp`, and their
/// `.sha256` markers) whose process no longer runs: what a download killed midway left behind.
/// Those of running processes (this one included) are kept. Returns how many entries were removed;
/// failures to list or remove are ignored (the next attempt tries again).
pub fn remove_stale_temp_files(dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(temp_owner) else { continue };
        if pid == std::process::id() || process_alive(pid) {
            continue;
        }
        let path = entry.path();
        let gone = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
        removed += gone.is_ok() as usize;
    }
    removed
}

/// The pid in a temporary name `.<name>.<pid>.<counter>.tmp[.sha256]` made by [`TempPath`].
fn temp_owner(file_name: &str) -> Option<u32> {
    let base = file_name.strip_suffix(".sha256").unwrap_or(file_name);
    let rest = base.strip_prefix('.')?.strip_suffix(".tmp")?;
    let mut parts = rest.rsplitn(3, '.');
    let (counter, pid, stem) = (parts.next()?, parts.next()?, parts.next()?);
    counter.parse::<u64>().ok()?;
    let pid = pid.parse::<u32>().ok().filter(|&p| p > 0 && p <= i32::MAX as u32)?;
    (!stem.is_empty()).then_some(pid)
}

/// Whether a process with this id exists (unknown platforms: assumed so, nothing is removed).
fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        // Signal 0 checks existence and permission only; EPERM means it exists but is not ours.
        // SAFETY: kill(2) with signal 0 sends nothing; `pid` is positive, so it names one process.
        let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
        r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Renames the directory `tmp` to `dest`; if another process got there first, keeps theirs.
#[cfg(feature = "fixtures")]
pub(super) fn persist_dir(tmp: TempPath, dest: &Path) -> Result<()> {
    match fs::rename(tmp.path(), dest) {
        Ok(()) => {
            let mut tmp = tmp;
            tmp.0 = None;
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
        Err(_) if dest.join("package").is_dir() => Ok(()),
        Err(e) => Err(Error::io(dest, e)),
    }
}

pub(super) fn create_parent(path: &Path) -> Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => fs::create_dir_all(dir).map_err(|e| Error::io(dir, e)),
        _ => Ok(()),
    }
}
