#!/usr/bin/env python3
"""mlx-lm's prompt-cache files of fixture models, and its greedy tokens after them.

For each case below, a fixture's float32 weights are loaded with mlx-lm (a word-level tokenizer
added in a temporary copy); ``generate_step`` runs the prefix ``[1, 2, …, 11]`` into a fresh
prompt cache with ``max_tokens=0`` (as ``mlx_lm.cache_prompt`` does: every prefix token
processed), ``save_prompt_cache`` writes it to ``crates/rmlx-lm/tests/fixtures/prompt_cache/CASE.safetensors``
(metadata ``model`` and ``tokenizer_config`` as ``cache_prompt`` writes them), and
``load_prompt_cache`` reads it back to continue greedily with the suffix ``[12, 13, 14]`` for 8
tokens. ``reference.json`` holds those ids and the ids of the uncached prompt prefix + suffix.
Run with mlx-lm's Python, e.g.:

    PYTHONPATH=~/.cache/rmlx/mlx-lm-0.32.2 python3 scripts/make_prompt_cache_references.py

With ``--check FILE CASE`` it instead loads a prompt-cache file written by rmlx for that case's
fixture and prints mlx-lm's 8 greedy tokens after it and the suffix (mlx-lm reading rmlx's file).
"""

import json
import os
import shutil
import sys
import tempfile

import mlx.core as mx
import mlx_lm
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_sampler

ROOT = os.path.join(os.path.dirname(__file__), "..", "crates", "rmlx-lm", "tests", "fixtures")
# case: (fixture, kv_bits): a KVCache, RotatingKVCache layers (Gemma 3's window of 8), a
# QuantizedKVCache.
CASES = {"qwen3": ("qwen3", None), "gemma3_text_pattern": ("gemma3_text_pattern", None), "qwen3_kv4": ("qwen3", 4)}
PREFIX = list(range(1, 12))
SUFFIX = [12, 13, 14]


def with_tokenizer(work, name):
    src = os.path.join(work, name)
    if not os.path.exists(src):
        shutil.copytree(os.path.join(ROOT, "models", name), src)
        with open(os.path.join(src, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        tok = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"},
        }
        with open(os.path.join(src, "tokenizer.json"), "w") as f:
            json.dump(tok, f)
        # A plain fast tokenizer (Gemma's class would look for its own `<unk>`).
        with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)
    model, _ = load(src)
    model.set_dtype(mx.float32)
    return model


def greedy(model, prompt, cache=None, n=8):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(temp=0.0), prompt_cache=cache)
    return [int(t) for t, _ in steps]


def main():
    work = tempfile.mkdtemp()
    out_dir = os.path.join(ROOT, "prompt_cache")
    os.makedirs(out_dir, exist_ok=True)
    out = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "prefix": PREFIX, "suffix": SUFFIX, "cases": {}}
    try:
        if len(sys.argv) == 4 and sys.argv[1] == "--check":
            fixture, _ = CASES[sys.argv[3]]
            model = with_tokenizer(work, fixture)
            cache = load_prompt_cache(sys.argv[2])
            print(json.dumps(greedy(model, SUFFIX, cache)))
            return
        for case, (fixture, bits) in CASES.items():
            model = with_tokenizer(work, fixture)
            cache = make_prompt_cache(model)
            kv = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=0) if bits else {}
            for _ in generate_step(mx.array(PREFIX), model, max_tokens=0, prompt_cache=cache, **kv):
                pass
            path = os.path.join(out_dir, f"{case}.safetensors")
            save_prompt_cache(path, cache, {"model": fixture, "tokenizer_config": json.dumps({})})
            after = greedy(model, SUFFIX, load_prompt_cache(path))
            whole = greedy(model, PREFIX + SUFFIX) if not bits else None
            out["cases"][case] = {"fixture": fixture, "kv_bits": bits, "after_cache": after, "uncached": whole}
            print(case, out["cases"][case])
    finally:
        shutil.rmtree(work)
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
