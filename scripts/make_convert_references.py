#!/usr/bin/env python3
"""What ``mlx_lm.convert`` writes for fixture models: the reference ``rmlx convert`` is checked against.

For each case below it copies a fixture model (``crates/rmlx-lm/tests/fixtures/models/<name>``) to
a temporary folder with a word-level tokenizer (``t0`` .. ``t<vocab-1>``), converts it with
mlx-lm's own ``convert`` and records, in ``crates/rmlx-lm/tests/fixtures/convert/reference.json``:
the written ``config.json`` and ``model.safetensors.index.json`` as JSON, and for every tensor of
every safetensors file its dtype, shape and the sha256 of its bytes (read from the file itself, so
that bfloat16 and packed integers hash alike), plus each file's metadata. Run it with mlx-lm's
Python, e.g.:

    python3 -m pip install --target ~/.cache/rmlx/mlx-lm-0.32.2 \\
        "mlx[cpu]==0.32.4" "mlx-lm==0.32.2"
    PYTHONPATH=~/.cache/rmlx/mlx-lm-0.32.2 python3 scripts/make_convert_references.py
"""

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile

import mlx.core as mx
import mlx_lm
from mlx_lm.convert import convert

ROOT = os.path.join(os.path.dirname(__file__), "..", "crates", "rmlx-lm", "tests", "fixtures")

# (case name, fixture, rmlx convert's flags, mlx_lm.convert's keyword arguments)
CASES = [
    ("qwen3_q4", "qwen3", ["-q"], {"quantize": True}),
    ("qwen3_q3_g32", "qwen3", ["-q", "--q-bits", "3", "--q-group-size", "32"],
     {"quantize": True, "q_bits": 3, "q_group_size": 32}),
    ("qwen3_q6_g128", "qwen3", ["-q", "--q-bits", "6", "--q-group-size", "128"],
     {"quantize": True, "q_bits": 6, "q_group_size": 128}),
    ("qwen3_q5_bf16", "qwen3", ["-q", "--q-bits", "5", "--dtype", "bfloat16"],
     {"quantize": True, "q_bits": 5, "dtype": "bfloat16"}),
    ("qwen3_q8_f16", "qwen3", ["-q", "--q-bits", "8", "--dtype", "float16"],
     {"quantize": True, "q_bits": 8, "dtype": "float16"}),
    ("qwen3_mxfp4", "qwen3", ["-q", "--q-mode", "mxfp4"], {"quantize": True, "q_mode": "mxfp4"}),
    ("qwen3_nvfp4", "qwen3", ["-q", "--q-mode", "nvfp4"], {"quantize": True, "q_mode": "nvfp4"}),
    ("qwen3_mxfp8", "qwen3", ["-q", "--q-mode", "mxfp8"], {"quantize": True, "q_mode": "mxfp8"}),
    ("qwen3_mixed_3_6", "qwen3", ["-q", "--quant-predicate", "mixed_3_6", "--q-group-size", "32"],
     {"quantize": True, "quant_predicate": "mixed_3_6", "q_group_size": 32}),
    ("gemma2_mixed_2_6", "gemma2", ["-q", "--quant-predicate", "mixed_2_6", "--q-group-size", "64"],
     {"quantize": True, "quant_predicate": "mixed_2_6", "q_group_size": 64}),
    ("qwen3_moe_q4", "qwen3_moe", ["-q", "--q-group-size", "32"], {"quantize": True, "q_group_size": 32}),
    ("mixtral_q8", "mixtral", ["-q", "--q-bits", "8"], {"quantize": True, "q_bits": 8}),
    ("gemma3_multimodal_q4", "gemma3_multimodal_prefix", ["-q"], {"quantize": True}),
    ("phi3_q4", "phi3", ["-q", "--q-group-size", "32"], {"quantize": True, "q_group_size": 32}),
    ("llama_gqa_bf16", "llama_gqa", ["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
    ("llama_gqa_q4_dequantized", "llama_gqa_q4", ["-d"], {"dequantize": True}),
]


def word_level_tokenizer(vocab):
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"},
    }


def tensors_of(path):
    """Every tensor of a safetensors file: dtype, shape and the sha256 of its bytes; the metadata."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    metadata = header.pop("__metadata__", {})
    out = {}
    for name, t in sorted(header.items()):
        a, b = t["data_offsets"]
        out[name] = {"dtype": t["dtype"], "shape": t["shape"], "sha256": hashlib.sha256(data[a:b]).hexdigest()}
    return out, metadata


def main():
    cases = {}
    work = tempfile.mkdtemp()
    try:
        for name, fixture, flags, kwargs in CASES:
            src = os.path.join(work, name + "-src")
            shutil.copytree(os.path.join(ROOT, "models", fixture), src)
            with open(os.path.join(src, "config.json")) as f:
                config = json.load(f)
            vocab = config.get("text_config", config).get("vocab_size", config.get("vocab_size"))
            with open(os.path.join(src, "tokenizer.json"), "w") as f:
                json.dump(word_level_tokenizer(vocab), f)
            with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
            dst = os.path.join(work, name)
            convert(src, dst, **kwargs)
            files = {}
            for fname in sorted(os.listdir(dst)):
                if fname.endswith(".safetensors"):
                    tensors, metadata = tensors_of(os.path.join(dst, fname))
                    files[fname] = {"metadata": metadata, "tensors": tensors}
            with open(os.path.join(dst, "config.json")) as f:
                out_config = json.load(f)
            with open(os.path.join(dst, "model.safetensors.index.json")) as f:
                index = json.load(f)
            cases[name] = {"fixture": fixture, "flags": flags, "config": out_config, "index": index, "files": files}
            print(name, "ok", file=sys.stderr)
    finally:
        shutil.rmtree(work)
    out_dir = os.path.join(ROOT, "convert")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump({"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "cases": cases}, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
