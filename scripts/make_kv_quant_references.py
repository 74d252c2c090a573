#!/usr/bin/env python3
"""mlx-lm's greedy tokens with a quantised key/value cache, for fixture models.

For each fixture and setting below, the fixture's float32 weights are loaded with mlx-lm (a
word-level tokenizer added in a temporary copy) and ``generate_step`` continues the prompt
``[1, 2, …, 11]`` greedily for 12 tokens with ``kv_bits``, ``kv_group_size`` and
``quantized_kv_start`` set; the ids go to ``crates/rmlx-lm/tests/fixtures/kv_quant/reference.json``
beside the full-precision ids. Run with mlx-lm's Python, e.g.:

    PYTHONPATH=~/.cache/rmlx/mlx-lm-0.32.2 python3 scripts/make_kv_quant_references.py
"""

import json
import os
import shutil
import tempfile

import mlx.core as mx
import mlx_lm
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

ROOT = os.path.join(os.path.dirname(__file__), "..", "crates", "rmlx-lm", "tests", "fixtures")
FIXTURES = ["qwen3", "mistral", "llama_mqa_untied", "qwen3_q4"]
# (bits, group size, quantised from position)
SETTINGS = [(8, 32, 0), (4, 32, 0), (4, 32, 14), (2, 32, 0)]
PROMPT = list(range(1, 12))


def main():
    work = tempfile.mkdtemp()
    out = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "prompt": PROMPT, "fixtures": {}}
    try:
        for name in FIXTURES:
            src = os.path.join(work, name)
            shutil.copytree(os.path.join(ROOT, "models", name), src)
            with open(os.path.join(src, "config.json")) as f:
                cfg = json.load(f)
            vocab = cfg.get("vocab_size")
            tok = {
                "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"},
            }
            with open(os.path.join(src, "tokenizer.json"), "w") as f:
                json.dump(tok, f)
            model, _ = load(src)
            model.set_dtype(mx.float32)
            runs = {}
            for bits, group, start in [(None, 64, 0)] + SETTINGS:
                ids = []
                steps = generate_step(
                    mx.array(PROMPT), model, max_tokens=12, sampler=make_sampler(temp=0.0),
                    kv_bits=bits, kv_group_size=group, quantized_kv_start=start,
                )
                for token, _ in steps:
                    ids.append(int(token))
                runs["full" if bits is None else f"{bits}/{group}/{start}"] = ids
            out["fixtures"][name] = runs
            print(name, runs)
    finally:
        shutil.rmtree(work)
    d = os.path.join(ROOT, "kv_quant")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
