//! The crate's own tests of what it keeps private: the file readers against hostile and fuzzed
//! files, the CPU and CUDA fast paths against MLX's own operations, the KV caches, the layers'
//! stacked weights. Tests of the public API are integration tests (`tests/`); both share the
//! fixture helpers of `tests/common`.

#[path = "../../tests/common/mod.rs"]
mod common;

mod batch_cache;
mod cpu_fast;
mod cpu_qmm;
mod cuda_attention;
mod cuda_fast;
mod cuda_lora;
mod cuda_moe;
mod cuda_packed_attention;
mod cuda_qmv;
mod cuda_sample;
mod cuda_step;
mod few_query_attention;
mod fuzz;
mod fuzz_files;
mod gguf;
mod gguf_model;
mod hostile_files;
mod rotating_cache;
mod stacked;
