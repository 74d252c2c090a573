#!/usr/bin/env python3
"""LoRA adapter fixtures made by mlx-lm itself, with the logits mlx-lm computes with them.

For each case below, loads a fixture model with ``mlx_lm.utils.load_model``, attaches adapters with
``mlx_lm.tuner.utils.linear_to_lora_layers`` (mlx-lm's own code: which layers, which orientation),
moves every ``lora_b`` away from zero (seeded), and writes into
``crates/rmlx-lm/tests/fixtures/adapters/<case>/``:

  adapters.safetensors   the adapter arrays, as mlx-lm's trainer saves them
  adapter_config.json    fine_tune_type, num_layers, lora_parameters (as mlx-lm writes them)
  reference.json         {"ids": [...], "logits": [[...]]}: the model's logits with the adapters,
                         computed in float32 (bfloat16 fixtures are converted first)

Needs: pip install mlx-lm "mlx[cpu]" (measured with mlx-lm 0.32.2, mlx 0.32.4). Run from the
project root: python scripts/make_adapter_fixtures.py [CASE ...]
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model

ROOT = Path("crates/rmlx-lm/tests/fixtures")
IDS = [1, 5, 9, 3, 7, 11]
CASES = {
    # name: (fixture model, num_layers, lora_parameters, fine_tune_type)
    "llama_gqa_all": ("llama_gqa", -1, {"rank": 4, "scale": 3.0, "dropout": 0.0}, "lora"),
    "qwen3_last_q_v": ("qwen3", 1, {"rank": 2, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}, "lora"),
    # DoRA: every magnitude `m` is moved off the base weight's row norms as well.
    "llama_gqa_dora": ("llama_gqa", 1, {"rank": 4, "scale": 2.0, "dropout": 0.0}, "dora"),
    # Mixture of experts: LoRASwitchLinear on the stacked experts, beside routers and attention.
    "qwen3_moe_all": ("qwen3_moe", -1, {"rank": 2, "scale": 4.0, "dropout": 0.0}, "lora"),
    # Phi-3: adapters on the fused qkv_proj and gate_up_proj, as mlx-lm's Phi-3 has them.
    "phi3_fused": ("phi3_mlx_lm", -1, {"rank": 2, "scale": 4.0, "dropout": 0.0}, "lora"),
}


def main(only=None):
    for case, (fixture, num_layers, params, fine_tune_type) in CASES.items():
        if only and case not in only:
            continue
        model, _ = load_model(ROOT / "models" / fixture)
        model.set_dtype(mx.float32)  # the reference is computed in float32 (the Rust test's dtype)
        model.freeze()
        mx.random.seed(0)  # before the adapters are made: their lora_a draws come from it too
        linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune_type == "dora")
        adapters = {}
        for name, value in tree_flatten(model.trainable_parameters()):
            if name.endswith("lora_b"):
                value = mx.random.normal(value.shape) * 0.1
            elif name.endswith(".m"):
                value = value * (1.0 + 0.2 * mx.random.normal(value.shape))
            adapters[name] = value
        model.load_weights(list(adapters.items()), strict=False)
        out = ROOT / "adapters" / case
        out.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
        config = {"fine_tune_type": fine_tune_type, "num_layers": num_layers, "lora_parameters": params}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
        logits = model(mx.array([IDS]))[0].astype(mx.float32)
        ref = {"mlx_lm": mlx_lm.__version__, "model": fixture, "ids": IDS, "logits": logits.tolist()}
        (out / "reference.json").write_text(json.dumps(ref) + "\n")
        print(case, len(adapters), "arrays")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])  # case names to (re)make; none: all
