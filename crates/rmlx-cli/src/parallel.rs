//! Commands run as the ranks of a job `rmlx launch` started (`RMLX_DISTRIBUTED` names the
//! backend, `MLX_RANK` the rank): which commands split their model over the ranks (tensor
//! parallelism), the group they join, and rank 0 alone writing results and progress (the
//! others report warnings and errors).

use anyhow::{bail, Context, Result};
use rmlx::distributed::{Backend, Group};
use rmlx_lm::Ranks;
use std::sync::OnceLock;

/// The backend of the job this process is a rank of, if any.
pub fn job_backend() -> Option<String> {
    std::env::var("RMLX_DISTRIBUTED").ok()
}

/// This process's rank in its job (`MLX_RANK`; 0 outside one).
pub fn job_rank() -> usize {
    match job_backend() {
        Some(_) => std::env::var("MLX_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0),
        None => 0,
    }
}

/// Refuses, inside a job, the commands that do not run over several ranks yet: every rank would
/// hold the whole model and do the same work (or serve the same port).
pub fn check_command(name: &str) -> Result<()> {
    const AS_RANKS: [&str; 8] =
        ["generate", "chat", "perplexity", "bench", "serve", "batch", "lora", "bench-collective"];
    if job_backend().is_some() && !AS_RANKS.contains(&name) {
        bail!(
            "`rmlx {name}` does not run as the ranks of a job yet; under `rmlx launch`, {} split their model \
             over the ranks and lora trains data-parallel",
            AS_RANKS[..6].join(", ")
        );
    }
    Ok(())
}

/// Rank 0 alone writes results and progress: the other ranks' standard output and error go to
/// /dev/null. Returns, on those ranks, the original standard error, where their errors and
/// warnings still go.
pub fn quiet_unless_rank0() -> Result<Option<std::fs::File>> {
    if job_rank() == 0 {
        return Ok(None);
    }
    use std::os::fd::{AsRawFd, FromRawFd};
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null").context("opening /dev/null")?;
    // SAFETY: dup and dup2 on open descriptors; the duplicate is owned by the returned File.
    let saved = unsafe { libc::dup(libc::STDERR_FILENO) };
    if saved < 0 {
        bail!("keeping the standard error of rank {}: {}", job_rank(), std::io::Error::last_os_error());
    }
    let saved = unsafe { std::fs::File::from_raw_fd(saved) };
    for fd in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
            bail!("quieting rank {}: {}", job_rank(), std::io::Error::last_os_error());
        }
    }
    Ok(Some(saved))
}

/// The ranks of the job this process is one of (its group joined on first use), or `None`
/// outside a job.
pub fn ranks() -> Result<Option<Ranks>> {
    static JOINED: OnceLock<Ranks> = OnceLock::new();
    let Some(name) = job_backend() else { return Ok(None) };
    if let Some(tp) = JOINED.get() {
        return Ok(Some(tp.clone()));
    }
    let backend: Backend = name.parse()?;
    let group = Group::init(backend, true).with_context(|| format!("joining the {name} group of this job"))?;
    tracing::info!("rank {} of {} ({name})", group.rank(), group.size());
    Ok(Some(JOINED.get_or_init(|| Ranks::new(group, backend)).clone()))
}
