"""Serving throughput and latency: `rmlx serve` against `mlx_lm.server`, side by side on the same
model folder (BENCHMARKS.md's serving rows). Standard library only.

Usage (on the GPU machine, after `source .gpu/b/device-setup`):
    python3 scripts/bench_serve.py --rmlx path/to/rmlx MODELS/qwen3-0.6b [--clients 32]
        [--max-tokens 256] [--rounds 2] [--skip-peer | --skip-rmlx]

Each of N clients runs `--rounds` streamed `/v1/completions` requests one after another, all at
once: the prompt is a shared ~300-word "system" text plus the client's own question (and, from the
second round, its previous answer), as a chat with a shared system prompt would be; greedy, a fixed
`max_tokens`, and a word-level tokenizer over the whole vocabulary (random-weight checkpoints from
make_model.py come without one). Tokens are counted from each stream's `usage` chunk. Reported per
server: aggregate completion tokens per second over the whole run (wall clock from the first request
to the last token), time to first token p50/p99, failed requests, and the GPU memory in use at the
end (nvidia-smi). Prints one JSON line per server and a summary line.
"""
import argparse, json, os, pathlib, random, signal, socket, statistics, subprocess, sys, threading, time
import http.client

import bench_lora  # the word-level tokenizer writer (this script's folder is on sys.path)

WORDS = 2000


def ensure_tokenizer(model: pathlib.Path):
    """A word-level tokenizer covering the whole embedding (every id decodes to a word), whose
    end-of-sequence token is id 0."""
    bench_lora.ensure_tokenizer(model, words=sys.maxsize)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, proc, timeout=600):
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/v1/models")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not start")


def connect_and_send(port, body, tries=50):
    """The response to a POST, retrying refused or reset connections (a server's accept backlog
    can overflow when every client connects at once; mlx_lm.server's holds 5)."""
    for attempt in range(tries):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            return c.getresponse()
        except (ConnectionError, http.client.RemoteDisconnected):
            time.sleep(0.05 * (attempt + 1))
    raise ConnectionError(f"no connection after {tries} tries")


def stream_completion(port, prompt, max_tokens, model=None):
    """One streamed request: (time to first token, tokens, text, ok). The time counts from the
    first connection attempt. `model`: an adapter's name (rmlx serve --adapter), else the base."""
    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    if model:
        request["model"] = model
    body = json.dumps(request)
    t0 = time.perf_counter()
    r = connect_and_send(port, body)
    if r.status != 200:
        return None, 0, r.read().decode(errors="replace"), False
    ttft, tokens, text = None, 0, []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices", []):
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(ch.get("text") or "")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return ttft, tokens, "".join(text), True


def gpu_memory_mb():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError):
        return None


def peak_memory_gb(port):
    """rmlx's own peak (its /metrics); None for a server without it."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/metrics")
        r = c.getresponse()
        if r.status != 200:
            return None
        for line in r.read().decode().splitlines():
            if line.startswith("rmlx_peak_memory_bytes "):
                return round(int(line.split()[1]) / 1e9, 2)
    except (OSError, http.client.HTTPException, ValueError):
        pass
    return None


def server_log_tail(label, lines=5):
    try:
        return open(f"/tmp/bench_serve_{label}.log").read().splitlines()[-lines:]
    except OSError:
        return []


def run_load(port, a):
    rng = random.Random(0)
    system = " ".join(f"w{rng.randint(1, WORDS - 1)}" for _ in range(300))
    questions = [" ".join(f"w{rng.randint(1, WORDS - 1)}" for _ in range(20)) for _ in range(a.clients)]
    # Warm-up (compilation, allocator): one request alone.
    stream_completion(port, system + " " + questions[0], 8)
    ttfts, tokens, failures = [], [0] * a.clients, [0]
    lock = threading.Lock()

    # With --adapters, client i asks for the base model, then each adapter in turn (i mod n).
    models = [None] + [spec.split("=")[0] for spec in a.adapters]

    def client(i):
        history = system + " " + questions[i]
        for _ in range(a.rounds):
            try:
                ttft, n, text, ok = stream_completion(port, history, a.max_tokens, models[i % len(models)])
            except (OSError, http.client.HTTPException, ValueError):
                ttft, n, text, ok = None, 0, "", False
            with lock:
                if not ok or ttft is None:
                    failures[0] += 1
                    continue
                ttfts.append(ttft)
                tokens[i] += n
            history = history + " " + text + " " + questions[(i + 1) % a.clients]

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts.sort()
    q = lambda p: ttfts[min(len(ttfts) - 1, int(round(p * (len(ttfts) - 1))))] if ttfts else None
    return {"clients": a.clients, "rounds": a.rounds, "max_tokens": a.max_tokens, "completion_tokens": sum(tokens),
            "wall_s": round(wall, 2), "tokens_per_sec": round(sum(tokens) / wall, 1),
            "ttft_p50_s": q(0.5), "ttft_p99_s": q(0.99), "failed": failures[0], "gpu_memory_mb": gpu_memory_mb(),
            "server_peak_memory_gb": peak_memory_gb(port)}


def metric(port, name):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def run_soak(port, a):
    """`--soak N` requests of mixed prompt and answer lengths from `--clients` workers; rmlx's
    active memory sampled every 100 requests (the curve) and at the end."""
    rng = random.Random(1)
    jobs = [(" ".join(f"w{rng.randint(1, WORDS - 1)}" for _ in range(rng.randint(1, 600))), rng.randint(1, 128))
            for _ in range(a.soak)]
    lock, done, failed, curve = threading.Lock(), [0], [0], []

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                prompt, max_tokens = jobs.pop()
            try:
                _, n, _, ok = stream_completion(port, prompt, max_tokens)
            except (OSError, http.client.HTTPException, ValueError):
                ok = False
            with lock:
                done[0] += 1
                failed[0] += 0 if ok else 1
                if done[0] % 100 == 0:
                    curve.append(round(metric(port, "rmlx_active_memory_bytes") / 1e9, 3))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)
    return {"soak_requests": a.soak, "failed": failed[0], "wall_s": round(time.perf_counter() - start, 1),
            "active_memory_gb_every_100": curve, "active_memory_gb_end": round(metric(port, "rmlx_active_memory_bytes") / 1e9, 3),
            "prompt_cache_gb_end": round(metric(port, "rmlx_prompt_cache_bytes") / 1e9, 3),
            "kv_cache_gb_end": round(metric(port, "rmlx_kv_cache_bytes") / 1e9, 3),
            "server_peak_memory_gb": peak_memory_gb(port)}


def serve(cmd, port, a, label):
    log = open(f"/tmp/bench_serve_{label}.log", "w")  # the server's stderr (a pipe could fill and block it)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        wait_ready(port, proc)
        result = run_soak(port, a) if a.soak else run_load(port, a)
        result["server"] = label
        if result["failed"]:
            result["log_tail"] = server_log_tail(label)
        print(json.dumps(result), flush=True)
        return result
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rmlx", default="target/release/rmlx")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-rmlx", action="store_true", help="mlx_lm.server only")
    ap.add_argument("--soak", type=int, default=0, help="rmlx only: this many mixed requests, memory curve")
    ap.add_argument("--rmlx-args", default="", help="extra arguments for rmlx serve")
    ap.add_argument("--adapter", dest="adapters", action="append", default=[], metavar="NAME=PATH",
                    help="rmlx only: serve this LoRA adapter too; clients spread over the base and the adapters")
    a = ap.parse_args()
    model = pathlib.Path(a.model)
    ensure_tokenizer(model)
    results = {}
    if not a.skip_rmlx:
        port = free_port()
        results["rmlx"] = serve([a.rmlx, "serve", "--model", str(model), "--port", str(port),
                                 "--max-batch", str(a.clients), *a.rmlx_args.split(),
                                 *[arg for spec in a.adapters for arg in ("--adapter", spec)]], port, a, "rmlx")
    if not a.skip_peer and not a.soak:
        port = free_port()
        results["mlx-lm"] = serve([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port),
                                   "--decode-concurrency", str(a.clients)], port, a, "mlx-lm")
    if len(results) == 2:
        r, m = results["rmlx"], results["mlx-lm"]
        print(json.dumps({"summary": model.name, "clients": a.clients,
                          "rmlx_tok_s": r["tokens_per_sec"], "mlx_lm_tok_s": m["tokens_per_sec"],
                          "speedup": round(r["tokens_per_sec"] / max(m["tokens_per_sec"], 1e-9), 3),
                          "rmlx_ttft_p99": r["ttft_p99_s"], "mlx_lm_ttft_p99": m["ttft_p99_s"],
                          "rmlx_ttft_p50": r["ttft_p50_s"], "mlx_lm_ttft_p50": m["ttft_p50_s"]}), flush=True)


if __name__ == "__main__":
    main()
