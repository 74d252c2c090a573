#!/usr/bin/env python3
"""Pure-read kernels over the bytes of 4-bit weight matrices (MLX's `mx.fast.cuda_kernel`, no
arithmetic): how fast the GPU reads them in the access pattern of rmlx's fused matrix-vector kernel
(A: a warp owns R rows, KW warps split a row, each lane 16 bytes of a row a step), in memory order
(B: grid-stride, 4 loads a thread in flight) and as whole consecutive rows a warp (C). Run it under
cupti_trace.c's LD_PRELOAD; each configuration runs 30 times over two copies of the matrix and
prints `MARK shape MB label` after its runs, in the order of the trace's kernels.
Usage: CUPTI_LIB=... CUPTI_TRACE_OUT=t.tsv LD_PRELOAD=libcupti_trace.so python3 read_patterns.py > marks.txt
       read_patterns.py --report t.tsv marks.txt   (p50 µs and TB/s a configuration, its first 5 runs left out)"""
import statistics, sys

import tracefile

# Runs of each configuration, and the first of them left out of its median.
RUNS, WARMUP = 30, 5

if len(sys.argv) == 4 and sys.argv[1] == "--report":
    kernels, _ = tracefile.window(sys.argv[2], 1e9)
    kernels = [k for k in kernels if "custom_kernel_read_" in k[2]]
    marks = [line.split(" ", 1)[1].strip() for line in open(sys.argv[3]) if line.startswith("MARK")]
    for i, mark in enumerate(marks):
        d = statistics.median((e - b) / 1000 for b, e, _ in kernels[i * RUNS + WARMUP:(i + 1) * RUNS])
        mb = float(mark.split()[1][:-2])
        print(f"{mark:36s} p50 {d:8.2f} us  {mb / d:5.2f} TB/s")
    sys.exit()

import mlx.core as mx

A_SRC = """
    // The scalar product's access pattern without arithmetic: a warp owns R rows, KW warps split a row.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = warp % KW;
    const long long row0 = (static_cast<long long>(blockIdx.x) * (4 / KW) + warp / KW) * R;
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    unsigned acc = 0;
    if (row0 < N) {
    for (int step = part; step < ROW4 / 32; step += KW) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint4 v = w4[(row0 + r) * ROW4 + step * 32 + lane];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    }
    const long long at = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (at < OUTN) out[at] = acc;
"""
B_SRC = """
    // Memory order, grid-stride: every load in flight within one window.
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const long long total = static_cast<long long>(N) * ROW4;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    unsigned acc = 0;
    long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < total; i += 4 * stride) {
        const uint4 a = w4[i], b = w4[i + stride], c = w4[i + 2 * stride], d = w4[i + 3 * stride];
        acc ^= a.x ^ b.y ^ c.z ^ d.w ^ a.w ^ b.x ^ c.y ^ d.z;
    }
    for (; i < total; i += stride) { const uint4 a = w4[i]; acc ^= a.x ^ a.w; }
    const long long at = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (at < OUTN) out[at] = acc;
"""
C_SRC = """
    // A warp streams R consecutive whole rows as one contiguous range, U loads a lane in flight.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row0 = (static_cast<long long>(blockIdx.x) * 4 + warp) * R;
    const uint4* w4 = reinterpret_cast<const uint4*>(w) + row0 * ROW4;
    unsigned acc = 0;
    if (row0 < N) {
    for (int j = lane; j < R * ROW4; j += 32 * U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint4 v = w4[j + 32 * u];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    }
    const long long at = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (at < OUTN) out[at] = acc;
"""
ka = mx.fast.cuda_kernel(name="read_rows_split", input_names=["w"], output_names=["out"], source=A_SRC)
kb = mx.fast.cuda_kernel(name="read_linear", input_names=["w"], output_names=["out"], source=B_SRC)
kc = mx.fast.cuda_kernel(name="read_rows_whole", input_names=["w"], output_names=["out"], source=C_SRC)

for (n, k) in ((4096, 12288), (12288, 4096), (151936, 4096)):
    row4 = k // 32
    ws = [mx.random.randint(0, 1 << 30, (n, k // 8), dtype=mx.uint32) for _ in range(2)]
    mx.eval(*ws)
    mb = n * k / 2 / 1e6
    runs = []
    for (r, kw) in ((2, 4), (2, 1), (8, 1), (4, 2)):
        blocks = (n + r * (4 // kw) - 1) // (r * (4 // kw))
        runs.append((f"A r{r} kw{kw}", ka, blocks, 128, [("N", n), ("ROW4", row4), ("R", r), ("KW", kw)]))
    for blocks in (132 * 8, 132 * 16):
        runs.append((f"B grid{blocks}", kb, blocks, 256, [("N", n), ("ROW4", row4)]))
    for (r, u) in ((4, 4), (8, 8)):
        blocks = (n + 4 * r - 1) // (4 * r)
        runs.append((f"C r{r} u{u}", kc, blocks, 128, [("N", n), ("ROW4", row4), ("R", r), ("U", u)]))
    for label, kern, blocks, threads, tmpl in runs:
        tmpl = tmpl + [("OUTN", blocks * threads)]
        for i in range(RUNS):
            o = kern(inputs=[ws[i % 2]], template=tmpl, grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1),
                     output_shapes=[(blocks * threads,)], output_dtypes=[mx.uint32])[0]
            mx.eval(o)
        print(f"MARK {n}x{k} {mb:.1f}MB {label}", flush=True)
