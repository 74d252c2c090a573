#!/usr/bin/env python3
"""The GPU's side of a trace written by cupti_trace.c: over the last SECONDS of kernel activity
(a steady decoding phase when the program ends with one), how busy the GPU was (the union of kernel
intervals over the span), how many kernels ran, the idle gaps between them, and the kernels that
took the time (each with the 10th, 50th and 90th percentiles and the maximum of its durations).
One JSON line with --json, else a table.
Usage: timeline.py TRACE [--seconds 0.5] [--top 12] [--json]"""
import argparse, collections, json

import tracefile

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--seconds", type=float, default=0.5)
ap.add_argument("--top", type=int, default=12)
ap.add_argument("--json", action="store_true")
a = ap.parse_args()
win, end = tracefile.window(a.trace, a.seconds)
start = win[0][0]
busy, cur_s, cur_e, gaps = 0, None, None, []
for s, e, _ in win:
    if cur_e is None or s > cur_e:
        if cur_e is not None:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
        cur_s, cur_e = s, e
    else:
        cur_e = max(cur_e, e)
busy += cur_e - cur_s
span = end - start
by = collections.defaultdict(lambda: [0, 0])
durations = collections.defaultdict(list)
for s, e, n in win:
    by[n][0] += e - s
    by[n][1] += 1
    durations[n].append(e - s)
pct = lambda n, q: round(sorted(durations[n])[min(int(q * len(durations[n])), len(durations[n]) - 1)] / 1e3, 2)
kernel_ns = sum(v[0] for v in by.values())
top = sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]
out = {
    "span_ms": round(span / 1e6, 3), "busy_fraction": round(busy / span, 4), "kernels": len(win),
    "kernel_time_ms": round(kernel_ns / 1e6, 3), "mean_kernel_us": round(kernel_ns / len(win) / 1e3, 2),
    "mean_gap_us": round(sum(gaps) / max(len(gaps), 1) / 1e3, 2), "gaps_over_20us_ms": round(sum(g for g in gaps if g > 20000) / 1e6, 3),
    "top": [{"name": n[:80], "ms": round(v[0] / 1e6, 3), "share": round(v[0] / kernel_ns, 4), "count": v[1], "mean_us": round(v[0] / v[1] / 1e3, 2), "p10_us": pct(n, 0.1), "p50_us": pct(n, 0.5), "p90_us": pct(n, 0.9), "max_us": pct(n, 1.0)} for n, v in top],
}
if a.json:
    print(json.dumps(out))
else:
    for k, v in out.items():
        if k != "top":
            print(f"{k}: {v}")
    for t in out["top"]:
        print(f"{t['ms']:9.3f} ms {t['share']*100:5.1f} % {t['count']:7d} x {t['mean_us']:8.2f} us "
              f"(p10 {t['p10_us']}, p50 {t['p50_us']}, p90 {t['p90_us']}, max {t['max_us']})  {t['name']}")
