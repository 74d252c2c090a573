//! Where the ranks of a job run and the environment each gets: N ranks on this machine, or the
//! hosts of an `mlx.launch` hostfile (`[{"ssh": "node1", "ips": ["10.0.0.1"]}, ...]`, or the
//! object form `{"backend": ..., "envs": ["K=V"], "hosts": [...]}`), `-n` ranks on each. A host
//! named `127.0.0.1`, `localhost` or this machine's hostname runs its ranks here; another is
//! reached by `ssh`, which runs rmlx at the same path in the same directory.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// One host of a hostfile.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// The name `ssh` reaches it by.
    pub ssh: String,
    /// Its addresses the other hosts reach it at (the ring listens on the first).
    #[serde(default)]
    pub ips: Vec<String>,
    /// JACCL's RDMA devices (read, not used: rmlx launches ring and NCCL jobs).
    #[serde(default)]
    #[allow(dead_code)]
    pub rdma: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum HostfileJson {
    Hosts(Vec<Host>),
    Full {
        hosts: Vec<Host>,
        #[serde(default)]
        backend: Option<String>,
        #[serde(default)]
        envs: Vec<String>,
    },
}

/// A hostfile: the hosts, and the backend and environment it may name.
#[derive(Debug, Default)]
pub struct Hostfile {
    pub hosts: Vec<Host>,
    pub backend: Option<String>,
    pub envs: Vec<(String, String)>,
}

impl Hostfile {
    /// This machine alone.
    pub fn here() -> Hostfile {
        let host = Host { ssh: "127.0.0.1".into(), ips: vec!["127.0.0.1".into()], rdma: None };
        Hostfile { hosts: vec![host], ..Hostfile::default() }
    }

    /// Reads and checks `path`.
    pub fn read(path: &Path) -> Result<Hostfile> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the hostfile {}", path.display()))?;
        let parsed: HostfileJson = serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: not a hostfile (a JSON list of {{\"ssh\": NAME, \"ips\": [IP, ...]}}, or an object with \
                 \"hosts\" such a list, optional \"backend\" and \"envs\")",
                path.display()
            )
        })?;
        let (hosts, backend, envs) = match parsed {
            HostfileJson::Hosts(hosts) => (hosts, None, Vec::new()),
            HostfileJson::Full { hosts, backend, envs } => (hosts, backend.filter(|b| !b.is_empty()), envs),
        };
        if hosts.is_empty() {
            bail!("{}: the hostfile lists no hosts", path.display());
        }
        let envs = envs
            .iter()
            .map(|e| match e.split_once('=') {
                Some((k, v)) if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') => {
                    Ok((k.to_string(), v.to_string()))
                }
                _ => bail!("{}: `{e}` in \"envs\" is not NAME=VALUE", path.display()),
            })
            .collect::<Result<_>>()?;
        Ok(Hostfile { hosts, backend, envs })
    }
}

/// One rank to start.
#[derive(Debug)]
pub struct RankPlan {
    /// The host to reach by ssh; `None`: this machine.
    pub remote: Option<String>,
    pub env: Vec<(String, String)>,
}

/// Whether `name` is this machine.
fn is_here(name: &str) -> bool {
    if matches!(name, "127.0.0.1" | "localhost" | "::1") {
        return true;
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    ok && std::str::from_utf8(&buf[..len]).is_ok_and(|h| h == name)
}

/// Where the ranks run and how they find each other.
pub struct Layout<'a> {
    /// The hosts, each running `per_host` ranks (rank `h · per_host + i` is host `h`'s `i`-th).
    pub hosts: &'a [Host],
    pub per_host: usize,
    pub backend: &'a str,
    /// The ring's first port (one more for each rank), or, on this machine alone, `None`: ports
    /// the system has free.
    pub starting_port: Option<u16>,
    /// NCCL's rendezvous port on the first host (`None`: one free here).
    pub nccl_port: Option<u16>,
    pub envs: &'a [(String, String)],
}

/// A port the system had free a moment ago.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Layout<'_> {
    /// Every rank's host and environment: `MLX_RANK`, `MLX_WORLD_SIZE`, `RMLX_DISTRIBUTED` (the
    /// backend, which rmlx's commands read to join the group), the ring's host list
    /// (`RMLX_RING_HOSTS`, JSON, which the rank writes to the file `MLX_HOSTFILE` names) or NCCL's
    /// address and the rank's GPU, and the hostfile's `envs`.
    pub fn plan(&self) -> Result<Vec<RankPlan>> {
        let n = self.hosts.len() * self.per_host;
        let mut shared = vec![
            ("MLX_WORLD_SIZE".to_string(), n.to_string()),
            ("RMLX_DISTRIBUTED".to_string(), self.backend.to_string()),
        ];
        shared.extend(self.envs.iter().cloned());
        match self.backend {
            "ring" => {
                let mut port = self.starting_port;
                let mut ring = Vec::new();
                for host in self.hosts {
                    let ip = host.ips.first().with_context(|| {
                        format!("host `{}` has no \"ips\": the ring backend needs the address it listens on", host.ssh)
                    })?;
                    for _ in 0..self.per_host {
                        let p = match &mut port {
                            Some(p) => {
                                *p = p.checked_add(1).context("ports past 65535")?;
                                *p - 1
                            }
                            None => free_port()?,
                        };
                        ring.push(vec![format!("{ip}:{p}")]);
                    }
                }
                shared.push(("RMLX_RING_HOSTS".to_string(), serde_json::to_string(&ring)?));
            }
            "nccl" => {
                let first = &self.hosts[0];
                let ip = first.ips.first().with_context(|| {
                    format!("host `{}` has no \"ips\": NCCL's ranks meet at the first host's address", first.ssh)
                })?;
                shared.push(("NCCL_HOST_IP".to_string(), ip.clone()));
                let port = match self.nccl_port {
                    Some(p) => p,
                    None => free_port()?,
                };
                shared.push(("NCCL_PORT".to_string(), port.to_string()));
            }
            other => bail!("backend `{other}`: rmlx launches `ring` and `nccl` jobs"),
        }
        let mut plans = Vec::with_capacity(n);
        for host in self.hosts {
            for local in 0..self.per_host {
                let mut env = shared.clone();
                env.push(("MLX_RANK".to_string(), plans.len().to_string()));
                let here = is_here(&host.ssh);
                if self.backend == "nccl" || (here && gpus_here() >= self.per_host) {
                    // One GPU a rank of this host.
                    env.push(("CUDA_VISIBLE_DEVICES".to_string(), local.to_string()));
                }
                plans.push(RankPlan { remote: (!here).then(|| host.ssh.clone()), env });
            }
        }
        Ok(plans)
    }
}

/// NVIDIA GPUs on this machine (the driver's list; 0 without one).
fn gpus_here() -> usize {
    std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count())
}

/// `s` quoted for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The command line `ssh` runs on a remote host: into this directory (where it exists there), the
/// rank's environment exported, the ring's host list written to a temporary file, then `exe args`.
pub fn remote_script(exe: &Path, args: &[String], env: &[(String, String)]) -> String {
    let mut script = String::new();
    if let Ok(dir) = std::env::current_dir() {
        let dir = shell_quote(&dir.display().to_string());
        script += &format!("if [ -d {dir} ]; then cd {dir}; fi; ");
    }
    for (k, v) in env {
        if k == "RMLX_RING_HOSTS" {
            script += &format!(
                "MLX_HOSTFILE=$(mktemp) && printf '%s' {} > \"$MLX_HOSTFILE\" && export MLX_HOSTFILE; ",
                shell_quote(v)
            );
        } else {
            script += &format!("export {k}={}; ", shell_quote(v));
        }
    }
    let command: Vec<String> = std::iter::once(exe.display().to_string()).chain(args.iter().cloned()).collect();
    script += "exec ";
    script += &command.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ");
    script
}
