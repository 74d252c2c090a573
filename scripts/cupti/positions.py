#!/usr/bin/env python3
"""Per-position kernel times of a decoding layer, from a trace written by cupti_trace.c: over the
last SECONDS of kernel activity, every run of KERNEL (default: rmlx's fused matrix-vector kernel)
is labelled by the kernel that ran before the run and its place in it, so that the products of a
layer separate (after the attention's merge kernel: 0 the output projection, 1 gate/up, 2 down, 3
the next layer's q/k/v) where timeline.py only pools them. One line a position: count, and the 10th,
50th and 90th percentiles of the durations in µs. One JSON line with --json.
Usage: positions.py TRACE [--seconds 0.4] [--kernel rmlx_fused_matvec] [--json]"""
import argparse, collections, json, statistics

import tracefile

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--seconds", type=float, default=0.4)
ap.add_argument("--kernel", default="rmlx_fused_matvec")
ap.add_argument("--json", action="store_true")
a = ap.parse_args()
window, _ = tracefile.window(a.trace, a.seconds)


def short(name):
    """A kernel's name without its C++ mangling noise (rmlx's kernels keep theirs)."""
    return name if name.startswith("rmlx_") else name[:40]


by_position = collections.defaultdict(list)
for i, (start, stop, name) in enumerate(window):
    if a.kernel not in name:
        continue
    j = i - 1
    while j >= 0 and a.kernel in window[j][2]:
        j -= 1
    before = short(window[j][2]) if j >= 0 else "start"
    by_position[(before, i - j - 1)].append((stop - start) / 1000)

out = []
for (before, place), durations in sorted(by_position.items(), key=lambda kv: -len(kv[1])):
    d = sorted(durations)
    out.append({"after": before, "place": place, "count": len(d), "p10": round(d[len(d) // 10], 2),
                "p50": round(statistics.median(d), 2), "p90": round(d[9 * len(d) // 10], 2)})
if a.json:
    print(json.dumps(out))
else:
    for o in out:
        print(f"after {o['after']} #{o['place']}: {o['count']:6d} x  p10 {o['p10']:7.2f}  p50 {o['p50']:7.2f}  "
              f"p90 {o['p90']:7.2f} us")
