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

/// The form of the adapters [`attach_adapters`] writes.
#[derive(Clone, Copy, Debug)]
pub enum AdapterForm {
    /// mlx-lm's LoRA layout.
    Lora,
    /// mlx-lm's layout with DoRA's magnitudes.
    Dora,
    /// PEFT's LoRA layout.
    Peft,
}

/// Attaches adapters of `form` to `whole` (rank 4, scale 2, on the last `num_layers` blocks)
/// with non-zero random factors (and magnitudes) drawn from `seed`, and writes them into `dir`:
/// the whole model adapted, to compare a split one loading the folder with.
pub fn attach_adapters(
    whole: &mut LoadedModel,
    dir: &std::path::Path,
    form: AdapterForm,
    num_layers: usize,
    seed: u64,
) {
    use rmlx_lm::nn::{ModuleExt, Role};
    use rmlx_lm::tuner::adapters::{self, AdapterConfig, FineTuneType};
    let config = rmlx_lm::tuner::LoraConfig { rank: 4, scale: 2.0, dropout: 0.0, keys: None };
    let model = whole.model.as_mut();
    match form {
        AdapterForm::Dora => rmlx_lm::tuner::apply_dora(model, Some(num_layers), &config, Dtype::Float32, seed),
        _ => rmlx_lm::tuner::apply_lora(model, Some(num_layers), &config, Dtype::Float32, seed),
    }
    .unwrap();
    // Fresh adapters leave the model unchanged (B = 0): trained ones do not.
    let mut changed = std::collections::HashMap::new();
    for (i, (name, role)) in model.roles("").into_iter().enumerate() {
        let current = model.parameters("").into_iter().find(|(n, _)| *n == name).unwrap().1;
        let key = rmlx::random::key(seed * 1000 + i as u64).unwrap();
        let noise = rmlx::random::normal(current.shape(), Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
        match role {
            Role::LoraB => drop(changed.insert(name, (noise * 0.05).unwrap())),
            Role::DoraMagnitude => {
                drop(changed.insert(name, (&current * ((noise * 0.1).unwrap() + 1.0).unwrap()).unwrap()))
            }
            _ => {}
        }
    }
    model.update("", changed).unwrap();
    match form {
        AdapterForm::Peft => drop(rmlx_lm::tuner::peft::save(model, dir, "base").unwrap()),
        AdapterForm::Lora | AdapterForm::Dora => {
            let fine_tune_type =
                if matches!(form, AdapterForm::Dora) { FineTuneType::Dora } else { FineTuneType::Lora };
            let cfg = AdapterConfig { fine_tune_type, num_layers: Some(num_layers), lora: config };
            adapters::save_config(dir, &cfg, &Default::default()).unwrap();
            let names = rmlx_lm::tuner::lora_parameter_names(model);
            adapters::save_weights(model, &names, &dir.join(adapters::WEIGHTS)).unwrap();
        }
    }
}

/// The fixture `name` whole with adapters of `form` attached (seed `seed`), and split (`load`
/// with `true`) with the same adapters read back from the folder they were written to, and the
/// prompt to compare them on. The adapters must move the whole model's logits.
pub fn adapted_pair(
    name: &str,
    form: AdapterForm,
    num_layers: usize,
    seed: u64,
    load: impl Fn(&std::path::Path, bool) -> LoadedModel,
) -> (LoadedModel, LoadedModel, Vec<u32>) {
    let dir = super::fixture_with_tokenizer(name);
    let adapters = super::TempDir::new("adapters");
    let mut whole = load(dir.path(), false);
    let prompt: Vec<u32> = (0..10u32).map(|i| (i * 5 + 2) % 30).collect();
    let (base, _) = logits(&whole, &prompt);
    attach_adapters(&mut whole, adapters.path(), form, num_layers, seed);
    let (adapted, _) = logits(&whole, &prompt);
    assert!(super::max_abs_diff(&base, &adapted) > 1e-3, "{name}: the adapters change nothing");
    let mut split = load(dir.path(), true);
    rmlx_lm::tuner::adapters::load(split.model.as_mut(), adapters.path(), Dtype::Float32)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    (whole, split, prompt)
}
