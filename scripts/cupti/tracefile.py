"""Reading a trace written by cupti_trace.c (one kernel a line: start ns, end ns, name, tab-separated)."""


def window(path, seconds):
    """The kernels that started in the last `seconds` of the trace's activity, in start order, as
    `(start_ns, end_ns, name)`, and the trace's last end."""
    rows = []
    for line in open(path):
        parts = line.rstrip("\n").split("\t", 2)
        if len(parts) == 3:
            rows.append((int(parts[0]), int(parts[1]), parts[2]))
    if not rows:
        raise SystemExit(f"{path}: no kernels")
    rows.sort()
    end = max(r[1] for r in rows)
    return [r for r in rows if r[0] >= end - int(seconds * 1e9)], end
