#!/usr/bin/env python3
"""Writes tests/data/quant_vectors.bin: random quantized blocks of every weight
type kvd dequantizes, with the floats that the `gguf` package's numpy
implementation (gguf.quants, an implementation independent of kvd's C code)
decodes them to. tests/unit/test_quant.c holds kvd's dequantizers against it.

NOT part of CI: it needs `pip install gguf numpy`; its output is committed.
Run it again only when the set of types or the format changes:

    python3 scripts/make_quant_vectors.py [-o tests/data/quant_vectors.bin] [--seed 1234]

File format (all little-endian):
    header : 8 bytes magic "KVDQVEC1", u32 version (1), u32 n_records
    record : u32 type (GGUF/ggml type id), u32 n_elems, u32 n_bytes,
             n_bytes of row data (consecutive blocks, as GGUF stores them),
             n_elems f32 expected values
Records follow each other with no padding.

The block bytes are uniformly random except the f16 scale fields, which get
finite values of sane magnitude (a few are zero, negative or subnormal, to
exercise the conversion), so every block is a valid one.
"""

import argparse
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

MAGIC = b"KVDQVEC1"
VERSION = 1

# type -> (number of blocks, byte offsets of f16 scale fields, kind of each)
# kind "d": a scale (can be negative); "m": an offset/minimum; "dk": a
# K-quant super-block scale (positive in practice, small).
BLOCK_TYPES = {
    T.Q4_0: (16, [(0, "d")]),
    T.Q4_1: (16, [(0, "d"), (2, "m")]),
    T.Q5_0: (16, [(0, "d")]),
    T.Q5_1: (16, [(0, "d"), (2, "m")]),
    T.Q8_0: (16, [(0, "d")]),
    T.Q4_K: (6, [(0, "dk"), (2, "dk")]),
    T.Q5_K: (6, [(0, "dk"), (2, "dk")]),
    T.Q6_K: (6, [(208, "dk")]),
}


def sane_f16(rng, kind, i):
    """A finite f16 value for scale field `kind` of block i."""
    if i == 1:
        return np.float16(0.0)                     # a zero scale
    if i == 2:
        return np.float16(-3.0e-6) if kind != "dk" else np.float16(2.0e-6)  # subnormal
    if kind == "d":
        mag = 10.0 ** rng.uniform(-3.0, 0.0)
        return np.float16(mag if rng.random() < 0.5 else -mag)
    if kind == "m":
        return np.float16(rng.uniform(-2.0, 2.0))
    return np.float16(10.0 ** rng.uniform(-4.0, -1.0))


def block_record(rng, qtype):
    n_blocks, fields = BLOCK_TYPES[qtype]
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for i in range(n_blocks):
        for off, kind in fields:
            raw[i, off:off + 2] = np.frombuffer(sane_f16(rng, kind, i).tobytes(), dtype=np.uint8)
    expected = quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    assert expected.size == n_blocks * block_elems
    assert np.all(np.isfinite(expected)), qtype.name
    return raw.tobytes(), expected


def f16_record(rng, n):
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    # clear one exponent bit where the exponent is all ones (inf/NaN)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & ~np.uint16(0x0400), bits).astype(np.uint16)
    bits[:4] = [0x0000, 0x8000, 0x0001, 0x83FF]   # zeros and subnormals
    expected = quants.dequantize(bits.view(np.uint8), T.F16).astype(np.float32).reshape(-1)
    return bits.tobytes(), expected


def bf16_record(rng, n):
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7F80) == 0x7F80, bits & ~np.uint16(0x0080), bits).astype(np.uint16)
    bits[:3] = [0x0000, 0x8000, 0x0001]
    expected = quants.dequantize(bits.view(np.uint8), T.BF16).astype(np.float32).reshape(-1)
    return bits.tobytes(), expected


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default="tests/data/quant_vectors.bin")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)

    records = [(T.F16,) + f16_record(rng, 512), (T.BF16,) + bf16_record(rng, 512)]
    for qtype in BLOCK_TYPES:
        records.append((qtype,) + block_record(rng, qtype))

    out = bytearray(MAGIC + struct.pack("<II", VERSION, len(records)))
    for qtype, data, expected in records:
        out += struct.pack("<III", int(qtype), expected.size, len(data))
        out += data
        out += expected.astype("<f4").tobytes()
    with open(args.output, "wb") as f:
        f.write(out)
    print(f"wrote {args.output}: {len(records)} records, {len(out)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
