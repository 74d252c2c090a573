"""Random-weight checkpoints in the real shapes of Phi-3.5-mini and Gemma-2-2B for the GPU machine (no hub
access there), as `../shared/gpu/make_model.py` writes the other families: transformers' own classes, bf16,
plus an MLX 4-bit (group 64) copy `NAME-q4` with mlx-lm's quantiser. These two families take paths of their
own in rmlx (LongRoPE with fused projections; soft-capped logits with alternating windows), so their
decode rows come from these. Usage: python3 scripts/make_family_models.py phi3.5-mini gemma2-2b [--out DIR]
[--q4]. Prints each folder written."""
import argparse, pathlib, torch
from transformers import AutoConfig, AutoModelForCausalLM

HALF_HEAD = 48  # Phi-3.5-mini: head_dim 96, one LongRoPE factor per rotated pair
SHAPES = {
    "phi3.5-mini": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=131072, original_max_position_embeddings=4096,
        sliding_window=262144, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000,
        pad_token_id=32000, rope_scaling={"type": "longrope",
            "short_factor": [1.0 + 0.08 * i / (HALF_HEAD - 1) for i in range(HALF_HEAD)],
            "long_factor": [1.0 + 40.0 * (i / (HALF_HEAD - 1)) ** 3 for i in range(HALF_HEAD)]}),
    "gemma2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, rope_theta=10000.0, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, tie_word_embeddings=True),
}


def make(name, out):
    path = pathlib.Path(out) / name
    if not (path / "config.json").exists():
        d = dict(SHAPES[name])
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+", choices=sorted(SHAPES))
    ap.add_argument("--out", default="/root/models")
    ap.add_argument("--q4", action="store_true")
    a = ap.parse_args()
    for n in a.names:
        p = make(n, a.out)
        print(p, flush=True)
        if a.q4:
            q = pathlib.Path(a.out) / f"{n}-q4"
            if not (q / "config.json").exists():
                from mlx_lm.utils import load_model, quantize_model, save_model, save_config
                model, config = load_model(p)
                model, config = quantize_model(model, config, group_size=64, bits=4)
                save_model(q, model)
                save_config(config, q / "config.json")
            print(q, flush=True)
