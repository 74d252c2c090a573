#!/usr/bin/env python3
"""LoRA adapters made by Hugging Face PEFT, with what transformers + PEFT compute with them: the
reference rmlx's LoRA gradients, optimizer step and PEFT interchange are tested against.

For each case below, loads a fixture model with transformers (float32, eager attention), wraps it
with ``peft.get_peft_model``, sets every ``lora_A``/``lora_B`` to seeded random values (B non-zero,
so that every factor has a gradient), saves the adapter with PEFT's own ``save_pretrained`` and
writes into ``crates/rmlx-lm/tests/fixtures/adapters/<case>/``:

  adapter_model.safetensors, adapter_config.json   the adapter, as PEFT writes it
  reference.json          the batch (``sequences``: tokens and loss offset per row; rows padded
                          with 0 to 1 + a multiple of 32, as rmlx and mlx-lm batch), ``loss``
                          (mean cross-entropy over the targets t with offset <= t+1 < length),
                          the AdamW settings, ``ids`` for the logits
  reference.safetensors   ``logits`` [len(ids), vocab] with the adapter; ``grad.<PEFT name>`` (the
                          loss's gradient for each adapter weight); ``adamw.<PEFT name>`` (the
                          weights after one ``torch.optim.AdamW`` step with those gradients);
                          DoRA cases also the magnitudes (``lora_magnitude_vector``)

With ``--check DIR`` it instead loads the PEFT adapter in DIR (e.g. one rmlx wrote with
``--adapter-format peft``) onto its fixture model (``--model NAME``) and writes ``DIR/peft_logits.json``:
the logits transformers + PEFT compute for ``ids``.

Needs: pip install torch transformers peft (made with torch 2.15.0, transformers 5.23.0,
peft 0.21.2, on CPU). Run from the project root: python scripts/make_peft_fixtures.py
"""

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path("crates/rmlx-lm/tests/fixtures")
IDS = [1, 5, 9, 3, 7, 11, 2, 40]
ADAMW = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
CASES = {
    # name: (fixture model, PEFT LoraConfig arguments, batch rows as (length, loss offset))
    "peft_llama_gqa": (
        "llama_gqa",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        [(21, 5), (14, 0)],
    ),
    # DoRA: a learned magnitude per output row (`lora_magnitude_vector`), moved off the row norms.
    "peft_llama_gqa_dora": (
        "llama_gqa",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True),
        [(19, 4), (12, 0)],
    ),
    # Biased q/k/v projections; adapters on q and v of the last layer only.
    "peft_qwen2": (
        "qwen2",
        dict(r=2, lora_alpha=16, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]),
        [(17, 0), (30, 9), (9, 2)],
    ),
}


def load(fixture):
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models" / fixture, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def batch(rows, vocab, seed):
    """Token rows padded with 0 to 1 + 32k columns, and the loss mask over the targets."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (length,), generator=g).tolist() for length, _ in rows]
    width = 1 + 32 * ((max(len(s) for s in seqs) + 31) // 32)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1)
    for i, (s, (length, offset)) in enumerate(zip(seqs, rows)):
        tokens[i, : len(s)] = torch.tensor(s)
        for t in range(width - 1):
            mask[i, t] = float(offset <= t + 1 < length)
    return [{"tokens": s, "offset": o} for s, (_, o) in zip(seqs, rows)], tokens, mask


def file_name(param):
    """The name of a PEFT parameter in adapter_model.safetensors: no adapter name (`.default`), and
    the magnitude vector without `.weight`."""
    n = param.replace(".default", "")
    return n.removesuffix(".weight") if "lora_magnitude_vector" in n else n


def loss_of(model, tokens, mask):
    logits = model(input_ids=tokens[:, :-1]).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return (ce * mask).sum() / mask.sum()


def make(case, fixture, lora_args, rows):
    out = ROOT / "adapters" / case
    out.mkdir(parents=True, exist_ok=True)
    model = get_peft_model(load(fixture), LoraConfig(lora_dropout=0.0, bias="none", **lora_args))
    g = torch.Generator().manual_seed(len(case))
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for n, p in adapters.items():
            if "lora_magnitude_vector" in n:
                p.mul_(1 + 0.4 * (torch.rand(p.shape, generator=g) - 0.5))
            else:
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / p.shape[1] ** 0.5)
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    seqs, tokens, mask = batch(rows, model.config.vocab_size, seed=len(case) + 1)
    model.train()  # dropout is 0: train mode only enables gradients as a trainer would
    loss = loss_of(model, tokens, mask)
    loss.backward()
    saved = {}
    for n, p in adapters.items():
        saved["grad." + file_name(n)] = p.grad.detach().clone()
    opt = torch.optim.AdamW(adapters.values(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"])
    opt.step()
    for n, p in adapters.items():
        saved["adamw." + file_name(n)] = p.detach().clone()
    model.eval()
    with torch.no_grad():
        # The logits of the adapter as saved (before the step): reload it to be sure.
        fresh = PeftModel.from_pretrained(load(fixture), out).eval()
        saved["logits"] = fresh(input_ids=torch.tensor([IDS])).logits[0].float()
    save_file({k: v.contiguous() for k, v in saved.items()}, out / "reference.safetensors")
    ref = {"fixture": fixture, "sequences": seqs, "loss": loss.item(), "adamw": ADAMW, "ids": IDS,
           "made_with": f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
                        f"peft {__import__('peft').__version__}"}
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(case, "loss", loss.item(), "arrays", len(saved))


def check(dir, fixture):
    with torch.no_grad():
        model = PeftModel.from_pretrained(load(fixture), dir).eval()
        logits = model(input_ids=torch.tensor([IDS])).logits[0].float()
    (Path(dir) / "peft_logits.json").write_text(json.dumps({"ids": IDS, "logits": logits.tolist()}) + "\n")
    print("wrote", Path(dir) / "peft_logits.json")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check")
    ap.add_argument("--model")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.check:
        check(a.check, a.model)
    else:
        for case, (fixture, lora_args, rows) in CASES.items():
            make(case, fixture, lora_args, rows)
