//! `rmlx launch`: starts one process per rank on this machine with the environment MLX's
//! distributed backends read (as `mlx.launch` does), prefixes each rank's output lines with its
//! rank, and stops every rank as soon as one fails (or the launcher itself ends).
//!
//! Ring (TCP, any device): `MLX_RANK`, `MLX_WORLD_SIZE` and `MLX_HOSTFILE`, a JSON list of one
//! `["127.0.0.1:PORT"]` per rank on free ports. NCCL (one CUDA GPU a rank): `MLX_RANK`,
//! `MLX_WORLD_SIZE`, `NCCL_HOST_IP`, `NCCL_PORT` and `CUDA_VISIBLE_DEVICES` (the rank's GPU).
//! Every rank also gets `RMLX_DISTRIBUTED` (the backend), which rmlx's commands read to join the
//! group.

use crate::common::positive;
use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Processes (ranks) to start on this machine.
    #[arg(short = 'n', long = "ranks", default_value_t = 2, value_parser = positive)]
    n: usize,
    /// MLX's distributed backend: `ring` (TCP sockets, CPUs or GPUs) or `nccl` (one CUDA GPU a
    /// rank: rank r sees GPU r).
    #[arg(long, default_value = "ring", value_parser = ["ring", "nccl"])]
    backend: String,
    /// The rmlx command every rank runs, after `--` (e.g. `-- bench-collective`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

/// A port the system had free a moment ago.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The environment of each rank.
fn rank_envs(n: usize, backend: &str, dir: &std::path::Path) -> Result<Vec<Vec<(String, String)>>> {
    let mut shared =
        vec![("MLX_WORLD_SIZE".to_string(), n.to_string()), ("RMLX_DISTRIBUTED".to_string(), backend.to_string())];
    if backend == "ring" {
        let hosts: Vec<Vec<String>> =
            (0..n).map(|_| Ok(vec![format!("127.0.0.1:{}", free_port()?)])).collect::<Result<_>>()?;
        let path = dir.join("hostfile.json");
        std::fs::write(&path, serde_json::to_string(&hosts)?).with_context(|| format!("writing {}", path.display()))?;
        shared.push(("MLX_HOSTFILE".to_string(), path.display().to_string()));
    } else {
        shared.push(("NCCL_HOST_IP".to_string(), "127.0.0.1".to_string()));
        shared.push(("NCCL_PORT".to_string(), free_port()?.to_string()));
    }
    Ok((0..n)
        .map(|rank| {
            let mut env = shared.clone();
            env.push(("MLX_RANK".to_string(), rank.to_string()));
            if backend == "nccl" {
                env.push(("CUDA_VISIBLE_DEVICES".to_string(), rank.to_string()));
            }
            env
        })
        .collect())
}

enum Event {
    Line { rank: usize, err: bool, line: String },
    Closed,
}

/// Forwards `reader`'s lines to the main thread, then says it is done.
fn forward(reader: impl std::io::Read + Send + 'static, rank: usize, err: bool, tx: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if tx.send(Event::Line { rank, err, line }).is_err() {
                return;
            }
        }
        let _ = tx.send(Event::Closed);
    });
}

pub fn run(a: Args) -> Result<()> {
    let exe = std::env::current_exe().context("finding the rmlx binary")?;
    let dir = std::env::temp_dir().join(format!("rmlx-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let envs = rank_envs(a.n, &a.backend, &dir)?;
    let (tx, rx) = mpsc::channel();
    let mut children: Vec<Child> = Vec::new();
    for (rank, env) in envs.iter().enumerate() {
        let mut command = Command::new(&exe);
        // A rank dies with the launcher (killed or not), never left waiting for its peers.
        // SAFETY: prctl is async-signal-safe, as code between fork and exec must be.
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let spawned = command
            .args(&a.command)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                bail!("starting rank {rank}: {e}");
            }
        };
        forward(child.stdout.take().expect("piped"), rank, false, tx.clone());
        forward(child.stderr.take().expect("piped"), rank, true, tx.clone());
        children.push(child);
    }
    drop(tx);
    let (mut open, mut status) = (2 * a.n, vec![None; a.n]);
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
        for rank in 0..a.n {
            if status[rank].is_none() {
                if let Some(s) = children[rank].try_wait()? {
                    status[rank] = Some(s);
                    if !s.success() && failed.is_none() {
                        failed = Some((rank, s));
                        // One rank gone: the others would wait for it forever.
                        stop(&mut children);
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some((rank, s)) = failed {
        bail!("rank {rank} of {} failed ({s}); the other ranks were stopped", a.n);
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
