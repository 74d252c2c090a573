#!/usr/bin/env python3
"""Tiny random-weight checkpoints made with mlx-lm's own model classes, with mlx-lm's greedy ids.

``--arch starcoder2`` (``starcoder2_mlx_lm``): an architecture the native backend does not
implement, so it runs only through the mlx-lm bridge (``crates/rmlx-lm/src/backend/mlx_lm/bridge.py``)
in the backend tests. ``--arch phi3`` (``phi3_mlx_lm``: fused ``qkv_proj`` and ``gate_up_proj``,
partial rotary embedding): the native Phi-3 checked against mlx-lm's greedy ids; ``--arch gpt_oss``
(``gpt_oss_mlx_lm``: mlx-lm's layout of gpt-oss, its experts stacked under ``mlp.experts`` with
biases, sinks, YaRN, a window of 4 on layer 0) likewise; ``--arch mixtral --quantize affine``
(``mixtral_q4_mlx_lm``: 4 experts, 2 a token, every linear layer and the routers 4-bit in groups
of 32 as ``mlx_lm.convert -q`` writes them, the experts stacked under ``switch_mlp``) the
quantised Mixtral; ``--arch mistral --quantize affine`` (``mistral_q4_mlx_lm``: a window of 4 on
layer 0, passed at the probe's fifth token; mlx-lm's llama module needs a full layer among them) the quantised Mistral. Run it with mlx-lm's
Python, e.g.:

    python3 -m pip install --target ~/.cache/rmlx/mlx-lm-0.32.2 \\
        "mlx[cpu]==0.32.4" "mlx-lm==0.32.2"
    PYTHONPATH=~/.cache/rmlx/mlx-lm-0.32.2 python3 scripts/make_mlx_lm_fixture.py --arch starcoder2 \\
        --out crates/rmlx-lm/tests/fixtures/models/starcoder2_mlx_lm

It writes ``config.json`` and ``model.safetensors`` (float32, about 200 KB) and nothing else: the
tests add a word-level tokenizer (``t0`` .. ``t511``) to a temporary copy.

The parameter names and shapes come from mlx-lm's own ``Model`` of the architecture; the values from numpy's
PCG64 generator, so the output is the same on every machine. Among seeds ``--seed``,
``--seed + 1``, ... the first one is kept whose greedy continuation of ``t1 t2 t3`` (float32, 16
tokens) has a top1 - top2 logit margin of at least ``--min-margin`` (0.1) at every step, never
emits the EOS id and has at least 12 distinct ids, so that backends that round differently (TF32
matmuls) still agree on the greedy ids. Finally the folder is loaded back with ``mlx_lm.load``
as a check.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_lm.models import gpt_oss, llama, mixtral, phi3, starcoder2

VOCAB = 512
EOS_ID = 2

PHI3 = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}

STARCODER2 = {
    "architectures": ["Starcoder2ForCausalLM"],
    "model_type": "starcoder2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "norm_epsilon": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}

GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 32},
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}

MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}

# mlx-lm reads `mistral` with its llama module, which slides only the layers `layer_types` names.
MISTRAL = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}

ARCHS = {"phi3": (phi3, PHI3), "starcoder2": (starcoder2, STARCODER2), "gpt_oss": (gpt_oss, GPT_OSS),
         "mixtral": (mixtral, MIXTRAL), "mistral": (llama, MISTRAL)}

PROBE_PROMPT = [1, 2, 3]  # "t1 t2 t3" with the tests' word-level tokenizer
PROBE_STEPS = 16


def random_weights(arch, seed):
    """Weights for every parameter of mlx-lm's Model of `arch`, drawn with numpy."""
    module, config = ARCHS[arch]
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(p.shape)  # RMSNorm gains around 1
        else:
            w = 0.5 * rng.standard_normal(p.shape)  # large: peaked, non-repetitive logits
        weights[name] = mx.array(w.astype(np.float32))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, weights


def greedy_probe(model):
    """Greedy ids for PROBE_PROMPT (no cache: full forward each step) and the smallest margin."""
    ids = list(PROBE_PROMPT)
    out, min_margin = [], float("inf")
    for _ in range(PROBE_STEPS):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        top2 = mx.sort(logits)[-2:].tolist()
        min_margin = min(min_margin, top2[1] - top2[0])
        nxt = int(mx.argmax(logits).item())
        out.append(nxt)
        ids.append(nxt)
    return out, min_margin


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="starcoder2")
    ap.add_argument("--out", required=True, help="output folder (created or overwritten)")
    ap.add_argument("--seed", type=int, default=0, help="first seed tried (default 0)")
    ap.add_argument("--min-margin", type=float, default=0.1)
    ap.add_argument("--quantize", choices=["mxfp4", "affine"], help="quantise with mlx-lm's nn.quantize in "
                    "this mode, 4 bits in groups of 32 (the probe then runs the quantised model): mxfp4 every "
                    "layer but gpt-oss's routers; affine every layer (Mixtral's routers included), as "
                    "mlx_lm.convert -q does")
    args = ap.parse_args()
    config = dict(ARCHS[args.arch][1])

    for seed in range(args.seed, args.seed + 1000):
        model, weights = random_weights(args.arch, seed)
        if args.quantize:
            import mlx.nn as nn
            q = {"group_size": 32, "bits": 4, "mode": args.quantize}
            nn.quantize(model, **q, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                        and not (args.quantize == "mxfp4" and p.endswith("router")))
            mx.eval(model.parameters())
            weights = dict(tree_flatten(model.parameters()))
            config["quantization"] = q
        greedy, margin = greedy_probe(model)
        if margin >= args.min_margin and EOS_ID not in greedy and len(set(greedy)) >= 12:
            break
    else:
        sys.exit("no seed found")

    os.makedirs(args.out, exist_ok=True)
    for stale in ("config.json", "model.safetensors"):
        if os.path.exists(os.path.join(args.out, stale)):
            os.remove(os.path.join(args.out, stale))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    mx.save_safetensors(
        os.path.join(args.out, "model.safetensors"), weights, metadata={"format": "mlx"}
    )

    # Check: mlx_lm.load reads the folder back (with the tests' tokenizer, in a temp copy) and
    # reproduces the probe.
    from mlx_lm import load

    tmp = tempfile.mkdtemp(prefix=f"{args.arch}_fixture_check_")
    try:
        for f in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(args.out, f), tmp)
        vocab = {f"t{i}": i for i in range(VOCAB)}
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
        }
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            json.dump(tokenizer, f)
        # Without it transformers picks the model type's own class (GPT-2's for starcoder2).
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
        loaded, tok = load(tmp)
        assert tok.encode("t1 t2 t3") == PROBE_PROMPT, tok.encode("t1 t2 t3")
        again, _ = greedy_probe(loaded)
        assert again == greedy, (again, greedy)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(
        f"wrote {args.out}: seed {seed}, {size} bytes, greedy(t1 t2 t3) = {greedy}, "
        f"min margin {margin:.3f}"
    )


if __name__ == "__main__":
    main()
