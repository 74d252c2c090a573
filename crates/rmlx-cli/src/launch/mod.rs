//! `rmlx launch`: starts the ranks of a job, on this machine or on the hosts of a hostfile (over
//! ssh), with the environment MLX's distributed backends read (as `mlx.launch` does), prefixes
//! each rank's output lines with its rank, and stops every rank as soon as one fails (or the
//! launcher itself ends).
//!
//! Ring (TCP, any device): `MLX_RANK`, `MLX_WORLD_SIZE` and `MLX_HOSTFILE`, a JSON list of one
//! `["IP:PORT"]` per rank. NCCL (one CUDA GPU a rank): `MLX_RANK`, `MLX_WORLD_SIZE`,
//! `NCCL_HOST_IP`, `NCCL_PORT` and `CUDA_VISIBLE_DEVICES` (the rank's GPU on its host; ring ranks
//! get one too where this machine has a GPU for each). Every rank also gets `RMLX_DISTRIBUTED`
//! (the backend), which rmlx's commands read to join the group.

mod hosts;

use crate::common::positive;
use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use hosts::{Hostfile, Layout};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Ranks to start: on this machine (default 2) or, with --hostfile, on each host (default 1).
    #[arg(short = 'n', long = "ranks", value_parser = positive)]
    n: Option<usize>,
    /// MLX's distributed backend: `ring` (TCP sockets, CPUs or GPUs) or `nccl` (one CUDA GPU a
    /// rank: rank r of a host sees its GPU r). Default: the hostfile's, else ring.
    #[arg(long, value_parser = ["ring", "nccl"])]
    backend: Option<String>,
    /// The hosts to run on, as mlx.launch reads them: a JSON list of `{"ssh": NAME, "ips": [IP]}`
    /// (or `{"hosts": [...], "backend": ..., "envs": ["K=V"]}`). A host that is not this machine
    /// is reached with `ssh NAME`, and must have rmlx at the same path.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// With --hostfile and the ring backend, the first rank's port (each next rank one more).
    #[arg(long, default_value_t = 32323)]
    starting_port: u16,
    /// With --hostfile and NCCL, the port the ranks meet at on the first host.
    #[arg(long, default_value_t = 12345)]
    nccl_port: u16,
    /// The rmlx command every rank runs, after `--` (e.g. `-- bench-collective`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

/// The ranks' hosts and environments.
fn plan(a: &Args) -> Result<Vec<hosts::RankPlan>> {
    let (file, per_host) = match &a.hostfile {
        Some(path) => (Hostfile::read(path)?, a.n.unwrap_or(1)),
        None => (Hostfile::here(), a.n.unwrap_or(2)),
    };
    let backend = a.backend.as_deref().or(file.backend.as_deref()).unwrap_or("ring");
    let layout = Layout {
        hosts: &file.hosts,
        per_host,
        backend,
        starting_port: a.hostfile.as_ref().map(|_| a.starting_port),
        nccl_port: a.hostfile.as_ref().map(|_| a.nccl_port),
        envs: &file.envs,
    };
    layout.plan()
}

/// Starts one rank: here, its ring host list in its own file of `dir`; elsewhere, through ssh. Rank 0
/// reads the launcher's standard input (`rmlx chat`), the others none.
fn spawn(
    exe: &std::path::Path,
    command: &[String],
    rank: usize,
    plan: &hosts::RankPlan,
    dir: &std::path::Path,
) -> Result<Child> {
    let mut cmd = match &plan.remote {
        None => {
            let mut cmd = Command::new(exe);
            cmd.args(command);
            for (k, v) in &plan.env {
                if k == "RMLX_RING_HOSTS" {
                    // A file of its own: writing one shared file again for the next rank emptied
                    // it while a rank already started read it (a parse error, now and then).
                    let path = dir.join(format!("hostfile-{rank}.json"));
                    std::fs::write(&path, v).with_context(|| format!("writing {}", path.display()))?;
                    cmd.env("MLX_HOSTFILE", path);
                } else {
                    cmd.env(k, v);
                }
            }
            cmd
        }
        Some(host) => {
            // A terminal on the far side, so that the rank ends with the connection.
            let mut cmd = Command::new("ssh");
            cmd.args(["-tt", "-o", "LogLevel=QUIET", host]).arg(hosts::remote_script(exe, command, &plan.env));
            cmd
        }
    };
    // A rank (or its ssh) dies with the launcher (killed or not), never left waiting for its peers.
    // SAFETY: prctl is async-signal-safe, as code between fork and exec must be.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let what = match &plan.remote {
        Some(host) => format!("ssh {host}"),
        None => exe.display().to_string(),
    };
    let stdin = if rank == 0 { Stdio::inherit() } else { Stdio::null() };
    cmd.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("running {what}"))
}

enum Event {
    Line { rank: usize, err: bool, line: String },
    Closed,
}

/// Forwards `reader`'s lines to the main thread, then says it is done.
fn forward(reader: impl std::io::Read + Send + 'static, rank: usize, err: bool, tx: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(mut line) = line else { break };
            // A remote rank's terminal ends its lines with \r\n.
            if line.ends_with('\r') {
                line.pop();
            }
            if tx.send(Event::Line { rank, err, line }).is_err() {
                return;
            }
        }
        let _ = tx.send(Event::Closed);
    });
}

/// How long the other ranks may run on once rank 0 has ended.
const RANK0_GRACE: Duration = Duration::from_secs(10);

pub fn run(a: Args) -> Result<()> {
    let exe = std::env::current_exe().context("finding the rmlx binary")?;
    let plans = plan(&a)?;
    let n = plans.len();
    let dir = std::env::temp_dir().join(format!("rmlx-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (tx, rx) = mpsc::channel();
    let mut children: Vec<Child> = Vec::new();
    for (rank, plan) in plans.iter().enumerate() {
        let mut child = match spawn(&exe, &a.command, rank, plan, &dir) {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(e.context(format!("starting rank {rank}")));
            }
        };
        forward(child.stdout.take().expect("piped"), rank, false, tx.clone());
        forward(child.stderr.take().expect("piped"), rank, true, tx.clone());
        children.push(child);
    }
    drop(tx);
    // A terminal's Ctrl-C reaches every rank, which answer it (`rmlx chat`'s rank 0 stops its
    // reply; the others of a chat ignore it; other commands end, failing the job): the launcher
    // waits for them rather than dying first and taking them all down.
    // SAFETY: setting a signal's disposition to ignored.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    let mut rank0_ended: Option<std::time::Instant> = None;
    let (mut open, mut status) = (2 * n, vec![None; n]);
    let mut failed: Option<(usize, std::process::ExitStatus)> = None;
    let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
    while status.iter().any(Option::is_none) || open > 0 {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(Event::Line { rank, err: false, line }) => {
                let _ = writeln!(stdout.lock(), "[rank {rank}] {line}");
            }
            Ok(Event::Line { rank, err: true, line }) => {
                let _ = writeln!(stderr.lock(), "[rank {rank}] {line}");
            }
            Ok(Event::Closed) => open -= 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => open = 0,
        }
        for rank in 0..n {
            if status[rank].is_none() {
                if let Some(s) = children[rank].try_wait()? {
                    status[rank] = Some(s);
                    // Once rank 0 has succeeded, the others' ends do not fail the job (a chat
                    // ended by Ctrl-C at its prompt leaves them to find their peer gone).
                    let after_rank0 = status[0].is_some_and(|s| s.success());
                    if !s.success() && failed.is_none() && !after_rank0 {
                        failed = Some((rank, s));
                        // One rank gone: the others would wait for it forever.
                        stop(&mut children);
                    }
                }
            }
        }
        // Rank 0 leads every command: once it has ended, the others have nothing left to do.
        if status[0].is_some() && status.iter().any(Option::is_none) {
            let since = *rank0_ended.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > RANK0_GRACE {
                let left: Vec<String> = (0..n).filter(|&r| status[r].is_none()).map(|r| r.to_string()).collect();
                eprintln!(
                    "rmlx launch: rank 0 ended {}s ago; stopping rank(s) {} still running",
                    RANK0_GRACE.as_secs(),
                    left.join(", ")
                );
                stop(&mut children);
                for rank in 0..n {
                    if status[rank].is_none() {
                        status[rank] = Some(children[rank].wait()?);
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some((rank, s)) = failed {
        bail!("rank {rank} of {n} failed ({s}); the other ranks were stopped");
    }
    Ok(())
}

/// Kills every rank still running.
fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
    }
}
