"""LoRA training throughput and peak memory: `rmlx lora` against mlx-lm's trainer, side by side on the
same model folders, data, batch, rank, layers and sequence length (BENCHMARKS.md's LoRA rows).

Usage (on the GPU machine, after `source .gpu/b/device-setup`):
    python3 scripts/bench_lora.py --rmlx .gpu/bin/rmlx MODELS/qwen3-0.6b MODELS/qwen3-0.6b-q4 \
        [--iters 60] [--grad-checkpoint both|off|on] [--repeats 1] [--rmlx-variant OTHER_BINARY]

Data: 256 training and 8 validation `{"text"}` examples of 380-420 words from a fixed seed; each word
is one token of a word-level tokenizer written into the model folder when it has none (random-weight
checkpoints from make_model.py come without one). Both trainers: batch 4, rank 8, scale 20, 16 layers,
max length 512, Adam at 1e-5, one validation batch. Throughput is each tool's own count of tokens in
the loss per second of training (validation excluded), the median over the reports after the first
(`--steps-per-report`, 10 iterations each by default); peak memory is MLX's peak at the end. Prints one JSON line per run and a
summary line per (model, checkpointing) pair.
"""
import argparse, json, os, pathlib, random, statistics, subprocess, sys, tempfile, time

WORDS = 2000


def ensure_tokenizer(model: pathlib.Path, words: int = WORDS):
    """A word-level tokenizer of `w0 … w{n-1}` (n: `words`, at most the embedding's rows; id 0 is
    `<eos>`), unless the folder has a tokenizer already: a real one, or one of these with at least
    that many tokens."""
    vocab_size = json.loads((model / "config.json").read_text()).get("vocab_size", words)
    n = min(words, vocab_size)
    path = model / "tokenizer.json"
    if path.exists():
        vocab = json.loads(path.read_text()).get("model", {}).get("vocab")
        if not (isinstance(vocab, dict) and set(vocab) <= {"<eos>", *(f"w{i}" for i in range(len(vocab)))}) or len(vocab) >= n:
            return
    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, n)}}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": "<eos>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<eos>"},
    }
    path.write_text(json.dumps(tok))
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "model_max_length": 1 << 20}))


def make_data(folder: pathlib.Path, words: int):
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in [("train", 256), ("valid", 8)]:
        with open(folder / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                k = rng.randint(380, 420)
                f.write(json.dumps({"text": " ".join(f"w{rng.randint(1, words - 1)}" for _ in range(k))}) + "\n")


def steady(reports):
    """Median tokens/s over the reports after the first, and the last peak memory."""
    tps = [r["tokens_per_sec"] for r in reports[1:]] or [r["tokens_per_sec"] for r in reports]
    return statistics.median(tps), reports[-1]["peak_memory_gb"]


def peer(a):
    """mlx-lm's own trainer (its `lora` command's code path), reporting through its callback."""
    import types
    import mlx.core as mx
    from mlx_lm import lora
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.utils import load
    args = vars(lora.build_parser().parse_args([]))
    args.update(model=a.peer, train=True, data=a.data, iters=a.iters, batch_size=4, num_layers=a.num_layers,
                max_seq_length=512, steps_per_report=a.steps_per_report, steps_per_eval=10**6, val_batches=1,
                save_every=10**6, adapter_path=tempfile.mkdtemp(), learning_rate=1e-5,
                grad_checkpoint=a.grad_checkpoint == "on")
    for k, v in lora.CONFIG_DEFAULTS.items():
        if args.get(k) is None:
            args[k] = v
    args = types.SimpleNamespace(**args)
    reports = []

    class Cb(TrainingCallback):
        def on_train_loss_report(self, info):
            reports.append({"iter": info["iteration"], "train_loss": info["train_loss"],
                            "tokens_per_sec": info["tokens_per_second"], "peak_memory_gb": info["peak_memory"]})

    model, tokenizer = load(args.model)
    train_set, valid_set, _ = lora.load_dataset(args, tokenizer)
    lora.train_model(args, model, train_set, valid_set, Cb())
    print(json.dumps(reports))


def lora_command(binary, model, data, iters, num_layers, adapters, steps_per_report=10):
    """`rmlx lora` with the settings mlx-lm is run with here: batch 4, max length 512, Adam at 1e-5,
    a report every `steps_per_report` iterations as JSON lines, no validation beyond the first, no
    checkpoints."""
    return [binary, "lora", "--model", str(model), "--train", "--data", str(data), "--iters", str(iters),
            "--batch-size", "4", "--num-layers", str(num_layers), "--max-seq-length", "512",
            "--steps-per-report", str(steps_per_report),
            "--steps-per-eval", str(10**6), "--val-batches", "1", "--save-every", str(10**6),
            "--adapter-path", adapters, "--learning-rate", "1e-5", "--json"]


def run_rmlx(a, model, data, checkpoint, uncompiled=False, binary=None):
    with tempfile.TemporaryDirectory() as adapters:
        cmd = lora_command(binary or a.rmlx, model, data, a.iters, a.num_layers, adapters, a.steps_per_report)
        if checkpoint:
            cmd.append("--grad-checkpoint")
        if uncompiled:
            cmd.append("--no-compile")
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"rmlx failed ({out.returncode}): {out.stderr[-2000:]}")
        return [r for r in map(json.loads, out.stdout.splitlines()) if "train_loss" in r]


def run_peer(a, model, data, checkpoint, uncompiled=False):
    cmd = [sys.executable, __file__, "--peer", str(model), "--data", str(data), "--iters", str(a.iters),
           "--num-layers", str(a.num_layers), "--steps-per-report", str(a.steps_per_report),
           "--grad-checkpoint", "on" if checkpoint else "off"]
    env = dict(os.environ, MLX_DISABLE_COMPILE="1") if uncompiled else None
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"mlx-lm failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--rmlx", default="target/release/rmlx")
    ap.add_argument("--rmlx-variant", action="append", default=[], metavar="PATH",
                    help="another rmlx binary to run beside --rmlx (an A/B of a change); repeatable")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--grad-checkpoint", default="off", choices=["off", "on", "both"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--num-layers", type=int, default=16)
    ap.add_argument("--steps-per-report", type=int, default=10,
                    help="iterations per report for both tools (1: the median is over single steps, so the few "
                         "steps that meet a batch shape for the first time do not move it)")
    ap.add_argument("--rmlx-uncompiled", action="store_true", help="also run rmlx with --no-compile")
    ap.add_argument("--peer-uncompiled", action="store_true",
                    help="also run mlx-lm with MLX_DISABLE_COMPILE=1 (how much its compiled step gains)")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        return peer(a)
    variants = {"off": [False], "on": [True], "both": [False, True]}[a.grad_checkpoint]
    root = pathlib.Path(tempfile.mkdtemp())
    for m in map(pathlib.Path, a.models):
        ensure_tokenizer(m)
        data = root / m.name
        make_data(data, min(WORDS, json.loads((m / "config.json").read_text()).get("vocab_size", WORDS)))
        for ckpt in variants:
            rows = {"mlx-lm": [], "rmlx": []}
            for rep in range(a.repeats):
                tools = [("mlx-lm", run_peer), ("rmlx", run_rmlx)]
                if a.peer_uncompiled:
                    tools.append(("mlx-lm uncompiled", lambda a, m, d, c: run_peer(a, m, d, c, uncompiled=True)))
                    rows.setdefault("mlx-lm uncompiled", [])
                for path in a.rmlx_variant:
                    label = f"rmlx {pathlib.Path(path).name}"
                    tools.append((label, lambda a, m, d, c, path=path: run_rmlx(a, m, d, c, binary=path)))
                    rows.setdefault(label, [])
                if a.rmlx_uncompiled:
                    tools.append(("rmlx uncompiled", lambda a, m, d, c: run_rmlx(a, m, d, c, uncompiled=True)))
                    rows.setdefault("rmlx uncompiled", [])
                for tool, fn in tools:
                    t0 = time.time()
                    reports = fn(a, m, data, ckpt)
                    tps, peak = steady(reports)
                    rows[tool].append((tps, peak))
                    print(json.dumps({"tool": tool, "model": m.name, "grad_checkpoint": ckpt, "repeat": rep,
                                      "tokens_per_sec": round(tps, 1), "peak_memory_gb": round(peak, 3),
                                      "final_train_loss": round(reports[-1]["train_loss"], 4),
                                      "wall_s": round(time.time() - t0, 1)}), flush=True)
            best = {t: (max(r[0] for r in v), max(r[1] for r in v)) for t, v in rows.items()}
            for label in rows:
                if label.startswith("rmlx "):
                    print(json.dumps({"variant": label, "model": m.name, "grad_checkpoint": ckpt,
                                      "tok_s": round(best[label][0]), "speedup": round(best[label][0] / best["mlx-lm"][0], 3),
                                      "peak_gb": round(best[label][1], 2)}), flush=True)
            print(json.dumps({"summary": m.name, "grad_checkpoint": ckpt,
                              "mlx_lm_tok_s": round(best["mlx-lm"][0]), "rmlx_tok_s": round(best["rmlx"][0]),
                              "speedup": round(best["rmlx"][0] / best["mlx-lm"][0], 3),
                              "mlx_lm_peak_gb": round(best["mlx-lm"][1], 2), "rmlx_peak_gb": round(best["rmlx"][1], 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
