#!/usr/bin/env python3
"""Writes the GGUF fixtures of crates/rmlx-lm/src/tests/gguf.rs (run with a Python that has `gguf`
(gguf-py) and numpy, e.g. a virtual environment made from scripts/requirements.txt):

* ``types.gguf``: metadata of every value type, and one small tensor of each ggml type rmlx
  reads, with valid blocks: quantised by gguf-py where it can quantise, otherwise random bytes
  whose scale fields are overwritten with sane float16 (or float32, E8M0) values. Data alignment
  64 (``general.alignment``), to exercise a non-default alignment.
* ``types_ref.gguf``: the float32 dequantisation of each of those tensors, same names, computed by
  gguf-py's ``gguf.quants.dequantize`` (numpy ``d * q`` for ``Q8_K``, which gguf-py lacks).

Deterministic (fixed seed); the two files together stay well under 200 KB.
"""

from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

OUT = Path(__file__).resolve().parent.parent / "crates/rmlx-lm/tests/fixtures/gguf"
rng = np.random.default_rng(20240917)


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype, rows, cols):
    """Random blocks of `qtype` for a [rows, cols] tensor, with sane scale fields."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_elems
    b = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    d = rng.uniform(0.002, 0.05, size=n) * rng.choice([-1, 1], size=n)
    dmin = rng.uniform(0.001, 0.02, size=n)
    if qtype in (T.Q4_K, T.Q5_K):  # d, dmin first
        b[:, 0:2] = f16_bytes(d)
        b[:, 2:4] = f16_bytes(dmin)
    elif qtype == T.Q2_K:  # scales, qs, then d, dmin
        b[:, 80:82] = f16_bytes(d)
        b[:, 82:84] = f16_bytes(dmin)
    elif qtype in (T.Q3_K, T.Q6_K):  # d last
        b[:, -2:] = f16_bytes(d)
    elif qtype == T.Q8_K:  # float32 d first
        b[:, 0:4] = np.asarray(d, dtype=np.float32).view(np.uint8).reshape(-1, 4)
    elif qtype in (T.IQ4_NL, T.IQ4_XS):
        b[:, 0:2] = f16_bytes(d)
    elif qtype == T.MXFP4:  # E8M0 exponent; include the subnormal codes 0 and 1
        b[:, 0] = rng.integers(110, 135, size=n)
        b[0, 0], b[1, 0] = 0, 1
    else:
        raise ValueError(qtype)
    return b.reshape(rows, cols // block_elems * block_bytes)


def reference(qtype, data):
    if qtype == T.Q8_K:  # d (f32), 256 int8, 16 int16 bsums
        blocks = data.reshape(-1, 292)
        d = blocks[:, 0:4].copy().view(np.float32)
        q = blocks[:, 4:260].view(np.int8).astype(np.float32)
        return (d * q).reshape(data.shape[0], -1)
    if qtype == T.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype in (T.I8, T.I16, T.I32, T.F64):
        return data.astype(np.float32)
    return dequantize(data, qtype).astype(np.float32)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(OUT / "types.gguf", arch="llama")
    w.add_custom_alignment(64)
    w.add_name("rmlx GGUF fixture")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float32("test.f32", 0.15625)
    w.add_float64("test.f64", -1.0e300)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo, wörld ✓")
    w.add_array("test.strings", ["a", "", "<0x0A>", "Ġthe"])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.nested", [[1, 2], [3]])

    tensors = {}
    x = rng.standard_normal((3, 8)).astype(np.float32)
    tensors["f32"] = (x, None)
    tensors["f16"] = (x.astype(np.float16), None)
    tensors["bf16"] = (quantize(x, T.BF16), T.BF16)
    tensors["i8"] = (rng.integers(-128, 128, size=(3, 8), dtype=np.int8), None)
    tensors["i16"] = (rng.integers(-32768, 32768, size=(3, 8), dtype=np.int16), None)
    tensors["i32"] = (rng.integers(-(2**24), 2**24, size=(3, 8), dtype=np.int32), None)
    tensors["f64"] = (rng.standard_normal((3, 8)), None)
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        src = rng.standard_normal((3, 64)).astype(np.float32) * 0.1
        tensors[qtype.name.lower()] = (quantize(src, qtype), qtype)
    src = rng.standard_normal((2, 3, 64)).astype(np.float32)
    tensors["q8_0_3d"] = (quantize(src, T.Q8_0), T.Q8_0)
    for qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K, T.IQ4_XS):
        tensors[qtype.name.lower()] = (random_blocks(qtype, 3, 512), qtype)
    for qtype in (T.IQ4_NL, T.MXFP4):
        tensors[qtype.name.lower()] = (random_blocks(qtype, 3, 64), qtype)

    ref = gguf.GGUFWriter(OUT / "types_ref.gguf", arch="llama")
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, data)
            r = reference({np.int8: T.I8, np.int16: T.I16, np.int32: T.I32, np.float64: T.F64}.get(data.dtype.type, T.F32), data) \
                if data.dtype != np.float16 else data.astype(np.float32)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
            r = reference(qtype, data)
        ref.add_tensor(name, np.ascontiguousarray(r, dtype=np.float32))

    for writer in (w, ref):
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    for f in ("types.gguf", "types_ref.gguf"):
        print(f, (OUT / f).stat().st_size, "bytes")


if __name__ == "__main__":
    main()
