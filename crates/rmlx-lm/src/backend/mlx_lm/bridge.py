"""rmlx's bridge to mlx-lm: runs a model with the Python mlx-lm package for the Rust side.

Embedded in the rmlx binary and run as ``python3 <this file>``; needs mlx-lm (0.32.2 tested, which
itself needs Python 3.11+; this file is 3.9+). JSON lines: requests on stdin, replies on stdout,
which carries nothing else (logs go to stderr). Every request has "op" and an integer "id"; every
reply repeats the "id". Errors: {"id", "error", "kind"}, kind one of bad_request, load, not_loaded,
generate, unsupported ("id" null when the line had no integer id).

  (start)          {"ready": true, "protocol": 1, "mlx_lm_version", "mlx_version", "model_types"}
                   or {"ready": false, "error"} and exit status 3 when mlx_lm cannot be imported
  load {path}      {"ok": true, "info": {...}}  (frees the loaded model first)
  info             {"ok": true, "info": {...}}
  generate {prompt | prompt_tokens, max_tokens, temperature, top_p, top_k, min_p, seed, stop,
            kv_bits, kv_group_size, quantized_kv_start}
  chat {messages, ...same}
                   {"token", "token_id", "logprob"} per token, the last one (when the
                   generation ends on it) with "finish_reason"; EOS is not sent. Then {"done": true,
                   "finish_reason": "length" | "stop" | "cancelled", "metrics": {...}, "tail"?}
                   where "tail" is text the detokenizer still held at the end (rare).
  cancel {target}  {"ok": true, "found": bool}; answered at once, even during a generation
  classify {prompts | prompt_tokens, top_logprobs, logits}
                   {"ok": true, "results": [{"prompt_tokens", "token_id", "token", "logprob",
                   "top": [[id, logprob]...], "logits"?}]}
  batch_generate {prompts | prompt_tokens, ...generation fields}
                   {"ok": true, "results": [{"text", "token_ids", "finish_reason",
                   "prompt_tokens"} | {"error"}],
                   "metrics": {...}}
  quit             {"ok": true}, exit status 0 (as at the end of stdin)

stdin is read on its own thread so that "cancel" works while a generation streams; every other
request runs on the main thread, one at a time, in arrival order.
"""

import gc
import json
import math
import os
import pkgutil
import queue
import signal
import sys
import threading

PROTOCOL = 1

# Keep the real stdout for the protocol and point file descriptor 1 (and sys.stdout) at stderr, so
# that nothing printed by mlx-lm, transformers or native code can corrupt the protocol stream.
_out = open(os.dup(1), "w", encoding="utf-8", errors="replace")
os.dup2(2, 1)
sys.stdout = sys.stderr
_out_lock = threading.Lock()

# The Rust side owns this process: Ctrl-C in its terminal must not kill us (it cancels or closes
# stdin instead). Local folders only, never the Hugging Face Hub (overridable by the caller).
signal.signal(signal.SIGINT, signal.SIG_IGN)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _finite(x):
    """x with every non-finite float replaced by None (JSON has no NaN / Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def send(obj):
    try:
        line = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        line = json.dumps(_finite(obj), ensure_ascii=False)
    try:
        with _out_lock:
            _out.write(line + "\n")
            _out.flush()
    except (BrokenPipeError, OSError):
        os._exit(0)  # the client is gone


try:
    import mlx.core as mx
    import mlx_lm
    import mlx_lm.models
    import mlx_lm.utils
    from mlx.utils import tree_flatten
    from mlx_lm.generate import BatchGenerator, stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler
except Exception as e:  # ImportError, or a broken install failing while importing
    send({"ready": False, "error": f"cannot import mlx_lm: {type(e).__name__}: {e}"})
    sys.exit(3)

VERSIONS = {"mlx_lm_version": mlx_lm.__version__, "mlx_version": mx.__version__}

# The config.json model_type values mlx-lm can load: its model modules (found without importing
# them, which would be slow; the few helper modules listed are harmless) and their aliases.
MODEL_TYPES = sorted(
    {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if not m.name.startswith("_")}
    | set(getattr(mlx_lm.utils, "MODEL_REMAPPING", {}))
)


class BridgeError(Exception):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind  # bad_request, load, not_loaded, generate or unsupported


def bad(message):
    return BridgeError("bad_request", message)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------
# State shared with the stdin thread: which requests are queued / running, and which to cancel.

_state_lock = threading.Lock()
_pending = set()  # ids queued or running
_cancelled = set()  # ids asked to stop


def is_cancelled(req_id):
    with _state_lock:
        return req_id in _cancelled


def read_stdin(requests):
    """Reads stdin: answers "cancel" at once, queues every other request for the main thread."""
    for raw in sys.stdin.buffer:
        line = raw.decode("utf-8", "replace").strip()
        if not line:
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            send({"id": None, "error": f"invalid JSON: {e}", "kind": "bad_request"})
            continue
        req_id = req.get("id") if isinstance(req, dict) else None
        if not is_int(req_id):
            send({"id": None, "error": 'a request is an object with an integer "id"',
                  "kind": "bad_request"})
            continue
        if req.get("op") == "cancel":
            target = req.get("target")
            if not is_int(target):
                send({"id": req_id, "error": 'cancel needs an integer "target"',
                      "kind": "bad_request"})
                continue
            with _state_lock:
                found = target in _pending
                if found:
                    _cancelled.add(target)
            send({"id": req_id, "ok": True, "found": found})
            continue
        with _state_lock:
            _pending.add(req_id)
        requests.put(req)
    requests.put(None)  # EOF


# ---------------------------------------------------------------------------------------------
# The model.

MODEL = None  # (model, tokenizer, info) once loaded


def _int(req, key, default, lo=0, hi=2**63 - 1):
    v = req.get(key)
    if v is None:
        return default
    if not is_int(v) or not lo <= v <= hi:
        raise bad(f'"{key}" must be an integer in [{lo}, {hi}]')
    return v


def _float(req, key, default, lo, hi=math.inf):
    v = req.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad(f'"{key}" must be a number in [{lo}, {hi}]')
    return float(v)


def model_info(model, tokenizer, config, path):
    text_config = config.get("text_config") or {}

    def cfg(*keys):
        for k in keys:
            for c in (config, text_config):
                if c.get(k) is not None:
                    return c[k]
        return None

    params = dict(tree_flatten(model.parameters()))
    embed = next((k for k in params if "embed" in k and k.endswith(".weight")), None)
    if embed is not None:
        scales = embed[: -len("weight")] + "scales"  # quantized: report the scales' dtype
        dtype = params[scales if scales in params else embed].dtype
    else:
        dtype = next(iter(params.values())).dtype
    quant = config.get("quantization")
    heads = cfg("num_attention_heads", "n_head", "n_heads")
    return dict(
        backend="mlx-lm",
        architecture=config.get("model_type"),
        vocab_size=cfg("vocab_size") or (params[embed].shape[0] if embed else None),
        layers=len(model.layers) if hasattr(model, "layers") else cfg("num_hidden_layers"),
        hidden_size=cfg("hidden_size", "n_embd", "d_model", "dim"),
        heads=heads,
        kv_heads=cfg("num_key_value_heads", "n_kv_heads", "num_kv_heads") or heads,
        quantization=None if not isinstance(quant, dict) else {
            k: quant[k] for k in ("bits", "group_size", "mode") if k in quant},
        dtype=str(dtype).rsplit(".", 1)[-1],
        device=str(mx.default_device()),
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        path=path,
        **VERSIONS,
    )


def op_load(req):
    global MODEL
    path = req.get("path")
    if not isinstance(path, str) or not path:
        raise bad('load needs a "path" (a model folder)')
    if not os.path.isdir(path):
        raise BridgeError("load", f"model folder not found: {path}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise BridgeError("load", f"no config.json in {path}")
    MODEL = None  # free the previous model before loading the next one
    gc.collect()
    mx.clear_cache()
    try:
        model, tokenizer, config = mlx_lm.utils.load(path, return_config=True)
    except Exception as e:
        raise BridgeError("load", f"mlx-lm could not load {path}: {type(e).__name__}: {e}")
    MODEL = (model, tokenizer, model_info(model, tokenizer, config, path))
    return {"ok": True, "info": MODEL[2]}


def loaded():
    if MODEL is None:
        raise BridgeError("not_loaded", "no model loaded (send a load request first)")
    return MODEL


def check_tokens(tokens, what):
    vocab = loaded()[2]["vocab_size"]
    if not isinstance(tokens, list) or not tokens:
        raise bad(f"{what} must be a non-empty list of token ids")
    for t in tokens:
        if not is_int(t) or not 0 <= t < vocab:
            raise bad(f"{what}: {t!r} is not a token id in [0, {vocab})")
    return tokens


def prompt_list(req, per_prompt_errors=False):
    """The token lists of a batched request: "inputs" (objects, each {"prompt": text},
    {"prompt_tokens": ids} or {"messages": [...]}), "prompts" (texts) or "prompt_tokens" (lists).
    With per_prompt_errors, an input that cannot be encoded becomes its BridgeError."""
    _, tokenizer, _ = loaded()
    if isinstance(req.get("inputs"), list) and req["inputs"]:
        out = []
        for x in req["inputs"]:
            try:
                if not isinstance(x, dict):
                    raise bad('an input is an object with "prompt", "prompt_tokens" or "messages"')
                out.append(prompt_of(x, "messages" in x))
            except BridgeError as e:
                if not per_prompt_errors:
                    raise
                out.append(e)
        return out
    if isinstance(req.get("prompts"), list) and req["prompts"]:
        if not all(isinstance(p, str) for p in req["prompts"]):
            raise bad('"prompts" must be a list of strings')
        return [tokenizer.encode(p) for p in req["prompts"]]
    if isinstance(req.get("prompt_tokens"), list) and req["prompt_tokens"]:
        return list(req["prompt_tokens"])
    raise bad('needs "inputs", "prompts" (non-empty list of strings) or "prompt_tokens" (list of lists)')


def prompt_of(req, chat):
    _, tokenizer, _ = loaded()
    if chat:
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
        ):
            raise bad('"messages" must be a non-empty list of {"role", "content"} objects')
        if not tokenizer.has_chat_template:
            raise BridgeError("unsupported", "this model's tokenizer has no chat template")
        try:
            tokens = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        except Exception as e:
            raise bad(f"the chat template failed: {type(e).__name__}: {e}")
        if isinstance(tokens, dict) or hasattr(tokens, "input_ids"):
            tokens = tokens["input_ids"]
        return check_tokens(list(tokens), "the chat prompt")
    if isinstance(req.get("prompt"), str):
        return check_tokens(tokenizer.encode(req["prompt"]), "the encoded prompt")
    if "prompt_tokens" in req:
        return check_tokens(req["prompt_tokens"], '"prompt_tokens"')
    raise bad('needs "prompt" (text) or "prompt_tokens" (list of token ids)')


def sampling(req):
    """(max_tokens, sampler, seed, stop strings) of a generation request, validated."""
    max_tokens = _int(req, "max_tokens", 256, lo=1)
    sampler = make_sampler(
        temp=_float(req, "temperature", 0.0, 0.0),
        top_p=_float(req, "top_p", 1.0, 0.0, 1.0),
        min_p=_float(req, "min_p", 0.0, 0.0, 1.0),
        top_k=_int(req, "top_k", 0, lo=0),
    )
    seed = _int(req, "seed", None)
    stop = req.get("stop") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad('"stop" must be a list of strings')
    return max_tokens, sampler, seed, [s for s in stop if s]


def hits_stop(text, new_len, stops):
    """Whether a stop string ends within the last new_len characters of text."""
    return any(s in text[-(new_len + len(s)) :] for s in stops)


def op_generate(req, chat=False):
    """Streams {"token", "token_id", "logprob"} lines, then returns the "done" line."""
    model, tokenizer, _ = loaded()
    prompt = prompt_of(req, chat)
    max_tokens, sampler, seed, stops = sampling(req)
    req_id = req["id"]
    if seed is not None:
        mx.random.seed(seed)
    # Our own copy of mlx-lm's streaming detokenizer: unlike stream_generate's, we can flush it
    # whatever ends the generation (EOS, stop string, cancel, length).
    detok = tokenizer.detokenizer
    eos = tokenizer.eos_token_ids
    text, n, last, finish = "", 0, None, None
    if not is_cancelled(req_id):
        # A quantised key/value cache (--kv-bits), as mlx-lm's generate takes it.
        kv = {}
        if req.get("kv_bits") is not None:
            kv = {"kv_bits": _int(req, "kv_bits", 8, lo=1, hi=8),
                  "kv_group_size": _int(req, "kv_group_size", 64, lo=1),
                  "quantized_kv_start": _int(req, "quantized_kv_start", 5000)}
        gen = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                              sampler=sampler, **kv)
        try:
            for r in gen:
                last = r
                if is_cancelled(req_id):
                    break
                if r.finish_reason == "stop" and r.token in eos:
                    finish = "stop"  # EOS: not sent as a token
                    break
                detok.add_token(r.token)
                piece = detok.last_segment
                n += 1
                text += piece
                if stops and hits_stop(text, len(piece), stops):
                    finish = "stop"  # the Rust side trims the text at the stop string
                elif r.finish_reason is not None:
                    finish = r.finish_reason
                line = {"id": req_id, "token": piece, "token_id": r.token,
                        "logprob": r.logprobs[r.token].item()}
                if finish is not None:
                    line["finish_reason"] = finish  # this is the last token line
                send(line)
                if finish is not None:
                    break
        except Exception as e:
            raise BridgeError("generate", f"generation failed: {type(e).__name__}: {e}")
        finally:
            gen.close()
    detok.finalize()
    done = {"done": True, "finish_reason": finish or "cancelled", "metrics": {
        "prompt_tokens": len(prompt),
        "generation_tokens": n,
        "prompt_tps": last.prompt_tps if last else 0.0,
        "generation_tps": last.generation_tps if last else 0.0,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }}
    tail = detok.last_segment  # text the detokenizer held back (e.g. an incomplete character)
    if tail:
        done["tail"] = tail
    return done


def op_classify(req):
    """One batched forward pass; the next-token distribution after each prompt."""
    model, tokenizer, info = loaded()
    prompts = [check_tokens(p, "a prompt") for p in prompt_list(req)]
    k = _int(req, "top_logprobs", 0, lo=0)
    k = min(k, info["vocab_size"])
    want_logits = bool(req.get("logits", False))
    # Pad the way mlx-lm 0.32.2's BatchGenerator prefills (PromptProcessingBatch.prompt): prompts
    # right-padded, the per-prompt caches merged into batch caches that are told the lengths
    # (BatchKVCache / ArraysCache mask the padding). Causal attention keeps the padding after a
    # prompt from touching its logits, which are read at each prompt's own last position.
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    padding = [width - n for n in lengths]
    try:  # per layer: one empty cache per prompt, merged (BatchKVCache for a KVCache, ...)
        per_prompt = [make_prompt_cache(model) for _ in prompts]
        cache = [layer[0].merge(list(layer)) for layer in zip(*per_prompt)]
    except (AttributeError, ValueError, NotImplementedError) as e:
        raise BridgeError("unsupported", f"this model's cache cannot be batched: {e}")
    try:
        if max(padding) > 0:
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        tokens = mx.array([p + [0] * (width - len(p)) for p in prompts])
        logits = model(tokens, cache=cache)
        last = logits[mx.arange(len(prompts)), mx.array(lengths) - 1].astype(mx.float32)
        logprobs = last - mx.logsumexp(last, axis=-1, keepdims=True)
        greedy = mx.argmax(last, axis=-1)
        order = mx.argsort(-logprobs, axis=-1)[:, :k]
        mx.eval(last, logprobs, greedy, order)
    except Exception as e:
        raise BridgeError("generate", f"forward pass failed: {type(e).__name__}: {e}")
    results = []
    for i, g in enumerate(greedy.tolist()):
        lp = logprobs[i]
        r = {"prompt_tokens": lengths[i], "token_id": g, "token": tokenizer.decode([g]),
             "logprob": lp[g].item(), "top": [[t, lp[t].item(), tokenizer.decode([t])] for t in order[i].tolist()]}
        if want_logits:
            r["logits"] = last[i].tolist()
        results.append(r)
    return {"ok": True, "results": results}


def op_batch_generate(req):
    """All prompts through mlx-lm's BatchGenerator; one reply with every result."""
    model, tokenizer, _ = loaded()
    max_tokens, sampler, seed, stops = sampling(req)
    req_id = req["id"]
    prompts = prompt_list(req, per_prompt_errors=True)
    results = [None] * len(prompts)
    valid = []
    for i, p in enumerate(prompts):
        try:
            if isinstance(p, BridgeError):
                raise p
            valid.append((i, check_tokens(p, "a prompt")))
        except BridgeError as e:
            results[i] = {"error": str(e)}
    if seed is not None:
        mx.random.seed(seed)
    metrics = {"prompt_tokens": 0, "generation_tokens": 0, "prompt_tps": 0.0,
               "generation_tps": 0.0, "peak_memory_gb": mx.get_peak_memory() / 1e9}
    if valid:
        # "ignore_eos" (benchmarks): every prompt gets its max_tokens.
        stop_tokens = [] if req.get("ignore_eos") else [[t] for t in tokenizer.eos_token_ids]
        gen = BatchGenerator(model, max_tokens=max_tokens, sampler=sampler, stop_tokens=stop_tokens)
        try:
            uids = gen.insert([p for _, p in valid], [max_tokens] * len(valid))
            index = {uid: i for uid, (i, _) in zip(uids, valid)}
            seqs = {uid: {"ids": [], "detok": tokenizer.detokenizer, "text": "", "finish": None}
                    for uid in uids}
            with gen.stats() as stats:
                while True:
                    if is_cancelled(req_id):
                        live = [u for u, s in seqs.items() if s["finish"] is None]
                        gen.remove(live)
                        for u in live:
                            seqs[u]["finish"] = "cancelled"
                        break
                    responses = gen.next_generated()
                    if not responses:
                        break
                    for r in responses:
                        s = seqs[r.uid]
                        if r.finish_reason != "stop":  # "stop" here is an EOS token: not kept
                            s["ids"].append(r.token)
                            s["detok"].add_token(r.token)
                            piece = s["detok"].last_segment
                            s["text"] += piece
                            if stops and hits_stop(s["text"], len(piece), stops):
                                if r.finish_reason is None:
                                    gen.remove([r.uid])
                                s["finish"] = "stop"
                                continue
                        if r.finish_reason is not None:
                            s["finish"] = r.finish_reason
            for uid, s in seqs.items():
                s["detok"].finalize()
                i = index[uid]
                results[i] = {"text": s["text"] + s["detok"].last_segment, "token_ids": s["ids"],
                              "finish_reason": s["finish"], "prompt_tokens": len(prompts[i])}
            metrics = {"prompt_tokens": sum(len(p) for _, p in valid),
                       "generation_tokens": stats.generation_tokens,
                       "prompt_tps": stats.prompt_tps, "generation_tps": stats.generation_tps,
                       "peak_memory_gb": stats.peak_memory}
        except Exception as e:
            raise BridgeError("generate", f"batch generation failed: {type(e).__name__}: {e}")
        finally:
            gen.close()
    return {"ok": True, "results": results, "metrics": metrics}


OPS = {
    "load": op_load,
    "info": lambda req: {"ok": True, "info": loaded()[2]},
    "generate": op_generate,
    "chat": lambda req: op_generate(req, chat=True),
    "classify": op_classify,
    "batch_generate": op_batch_generate,
}


def main():
    send({"ready": True, "protocol": PROTOCOL, **VERSIONS, "model_types": MODEL_TYPES})
    requests = queue.Queue()
    threading.Thread(target=read_stdin, args=(requests,), daemon=True).start()
    while True:
        req = requests.get()
        if req is None:
            break  # stdin closed: every request read before it has been answered
        req_id, op = req["id"], req.get("op")
        try:
            if op == "quit":
                send({"id": req_id, "ok": True})
                break
            if not isinstance(op, str) or op not in OPS:
                raise bad(f"unknown op {op!r}" if op is not None else 'missing "op"')
            send({"id": req_id, **OPS[op](req)})
        except BridgeError as e:
            send({"id": req_id, "error": str(e), "kind": e.kind})
        except Exception as e:  # a bug, or an mlx error outside the guarded calls
            send({"id": req_id, "error": f"{type(e).__name__}: {e}", "kind": "generate"})
        finally:
            with _state_lock:
                _pending.discard(req_id)
                _cancelled.discard(req_id)
    _out.flush()
    os._exit(0)  # skip interpreter teardown (the stdin thread may still block in read)


if __name__ == "__main__":
    main()
