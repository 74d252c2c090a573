"""Writes a word-level tokenizer.json (t0 ... t{vocab-1}) into each model folder (random-weight models ship none)."""
import json, sys, pathlib
for d in sys.argv[1:]:
    d = pathlib.Path(d)
    vocab = json.load(open(d / "config.json"))["vocab_size"]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"}}
    json.dump(tok, open(d / "tokenizer.json", "w"))
