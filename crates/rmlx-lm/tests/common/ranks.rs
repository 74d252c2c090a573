//! Jobs of several ranks over MLX's ring backend on this machine, for the tests of split models:
//! the test binary runs one of its own ignored tests as every rank, with the environment `rmlx
//! launch` sets, and checks that every rank succeeded and printed `ok <name>` for each name; and
//! what each rank computes to compare a split model with the whole one.

use rmlx::{Array, Dtype};
use rmlx_lm::{GenerateOptions, LoadedModel};
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Runs the ignored test `rank_test` of this binary as `n` ranks of one ring group and asserts
/// that each exits successfully having printed `ok <name>` for every one of `names`.
pub fn run_ranks(rank_test: &str, n: usize, names: &[&str]) {
    let dir = super::TempDir::new("ring");
    let hostfile = dir.path().join("hosts.json");
    let hosts: Vec<String> = (0..n).map(|_| format!("[\"127.0.0.1:{}\"]", free_port())).collect();
    std::fs::write(&hostfile, format!("[{}]", hosts.join(", "))).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..n)
        .map(|rank| {
            Command::new(&exe)
                .args(["--ignored", "--exact", rank_test, "--nocapture", "--test-threads", "1"])
                .env("MLX_RANK", rank.to_string())
                .env("MLX_WORLD_SIZE", n.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Read every rank's output while they run (a full pipe would stall a rank and its peers).
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let (mut out, mut err) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
            std::thread::spawn(move || {
                let (mut o, mut e) = (String::new(), String::new());
                out.read_to_string(&mut o).unwrap();
                err.read_to_string(&mut e).unwrap();
                (o, e)
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut statuses = vec![None; n];
    while statuses.iter().any(Option::is_none) && Instant::now() < deadline {
        for (s, c) in statuses.iter_mut().zip(&mut children) {
            if s.is_none() {
                *s = c.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for c in &mut children {
        let _ = c.kill();
    }
    for (rank, (status, reader)) in statuses.iter().zip(readers).enumerate() {
        let (out, err) = reader.join().unwrap();
        assert!(status.is_some_and(|s| s.success()), "rank {rank}: {status:?}\n{out}\n{err}");
        for name in names {
            assert!(out.contains(&format!("ok {name}\n")), "rank {rank} did not check {name}:\n{out}\n{err}");
        }
    }
}

/// The prompt's logits in one pass, then one token at a time through fresh caches.
pub fn logits(lm: &LoadedModel, prompt: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let read = |a: Array| a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let whole = read(lm.model.forward(&super::ids_array(prompt), &mut lm.model.new_caches(None)).unwrap());
    let mut caches = lm.model.new_caches(None);
    let steps =
        prompt.iter().flat_map(|&t| read(lm.model.forward(&super::ids_array(&[t]), &mut caches).unwrap())).collect();
    (whole, steps)
}

/// `n` greedy tokens after `prompt` (prefilled 5 tokens a chunk), end of sequence ignored.
pub fn greedy(lm: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let opts = GenerateOptions { max_tokens: n, ignore_eos: true, prefill_chunk: 5, ..GenerateOptions::default() };
    lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect()
}
