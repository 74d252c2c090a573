#!/usr/bin/env python3
"""Host CPU profile of a program between two lines of its output, with host_sampler.c.

run:   host_profile.py run --lib libhost_sampler.so --out F --start REGEX --stop REGEX -- CMD...
       runs CMD with the sampler preloaded, turns sampling on (SIGUSR2) at the first output line
       matching --start and off at the first matching --stop (stdout and stderr both read).
name:  host_profile.py name F [--binary NAME=PATH ...] [--top 40]
       names each sampled address with the symbol table of a local copy of its library (`nm -C`:
       rmlx's unstripped build, MLX's libmlx.so from the wheel) or the exported name the sampler
       found, sums by function and prints the functions by self and total samples, and the
       libraries by self samples."""
import argparse, bisect, collections, os, re, signal, subprocess, sys, threading


def run(a):
    env = dict(os.environ, LD_PRELOAD=os.path.abspath(a.lib), HOST_SAMPLER_OUT=os.path.abspath(a.out))
    p = subprocess.Popen(a.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    state = {"on": False, "done": False}
    lock = threading.Lock()

    def pump(stream, sink):
        for line in stream:
            sink.write(line)
            with lock:
                if not state["on"] and not state["done"] and re.search(a.start, line):
                    os.kill(p.pid, signal.SIGUSR2)
                    state["on"] = True
                    sink.write("[host_profile] sampling on\n")
                elif state["on"] and re.search(a.stop, line):
                    os.kill(p.pid, signal.SIGUSR2)
                    state["on"], state["done"] = False, True
                    sink.write("[host_profile] sampling off\n")

    t = threading.Thread(target=pump, args=(p.stdout, sys.stdout))
    t.start()
    pump(p.stderr, sys.stderr)
    t.join()
    sys.exit(p.wait())


class Symbols:
    def __init__(self, path):
        out = subprocess.run(["nm", "-C", "--defined-only", "-n", path], capture_output=True, text=True).stdout
        self.addrs, self.names = [], []
        for line in out.splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[1] in "tTwWiI":
                self.addrs.append(int(parts[0], 16))
                self.names.append(parts[2])

    def name(self, off):
        i = bisect.bisect_right(self.addrs, off) - 1
        return self.names[i] if i >= 0 else None


def name(a):
    local = dict(b.split("=", 1) for b in a.binary)
    tables = {}
    self_by, total_by, lib_self = collections.Counter(), collections.Counter(), collections.Counter()
    header = []
    for line in open(a.file):
        if not line.startswith("addr "):
            header.append(line.rstrip())
            continue
        _, s, t, lib, off, exported = line.split(" ", 5)
        base = os.path.basename(lib)
        fn = None
        if base in local:
            if base not in tables:
                tables[base] = Symbols(local[base])
            fn = tables[base].name(int(off, 16))
        if fn is None:
            fn = exported.strip() if exported.strip() != "-" else f"{base}+{off}"
        key = f"{fn}  [{base}]"
        self_by[key] += int(s)
        total_by[key] += int(t)
        lib_self[base] += int(s)
    total = sum(self_by.values()) or 1
    print("\n".join(header))
    print(f"\n## by library (self samples, {total} in all)")
    for k, v in lib_self.most_common(15):
        print(f"{v:8d} {100 * v / total:5.1f}%  {k}")
    print(f"\n## functions by self samples")
    for k, v in self_by.most_common(a.top):
        print(f"{v:8d} {100 * v / total:5.1f}%  {k[:200]}")
    print(f"\n## functions by total samples (on the stack)")
    for k, v in total_by.most_common(a.top * 2):
        print(f"{v:8d} {100 * v / total:5.1f}%  {k[:200]}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--lib", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--start", required=True)
    r.add_argument("--stop", required=True)
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    n = sub.add_parser("name")
    n.add_argument("file")
    n.add_argument("--binary", action="append", default=[])
    n.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    if a.mode == "run":
        if a.cmd and a.cmd[0] == "--":
            a.cmd = a.cmd[1:]
        run(a)
    else:
        name(a)


if __name__ == "__main__":
    main()
