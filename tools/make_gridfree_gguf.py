#!/usr/bin/env python3
"""Make a grid-free F16 GGUF from a quantized GGUF, for the quantization quality run (bench/quant_quality.sh).

Every real model here is already 4-6-bit, so a format that happens to reproduce the source's own grid scores
a near-zero KL that says nothing about the format. This script dequantizes every quantized tensor (gguf-py's
reference dequantization), adds seeded noise to each block of 32 values, and writes the result as F16 (the 2-D matrices)
with the 1-D tensors (norms, biases) and F32/F16 tensors copied unchanged, all metadata copied, and
`general.file_type` set to 1 (mostly F16).

Noise: uniform in ±`--noise`·step (default 0.5: ±half a step, the source's own rounding error; its
characteristic function sinc(k) vanishes at every integer frequency k, so the values keep no trace of a
grid of that step, at the least noise that achieves this: rms 0.29 step), or with `--dist gaussian` normal
with standard deviation `--noise`·step (at 0.5 it erases the grid too but adds 1.7× the rms and damages
the model more: on Qwen2.5-Coder-1.5B KL 0.125 against the original).

Step of a block of 32 values: (max - min) / (2^bits - 1) of its dequantized values, bits the code width of
the tensor's type (Q4_0/Q4_1/Q4_K 4, Q5_0/Q5_1/Q5_K 5, Q6_K 6, Q8_0 8, Q2_K 2, Q3_K 3): the spacing of
the grid's codes if the block used its full range (k-quants' sub-blocks of 16/32 have their own scales; the
block range is an upper bound of their step).

usage: make_gridfree_gguf.py SRC.gguf OUT.gguf [--seed 14] [--noise 0.5] [--dist uniform|gaussian]
needs: pip install gguf numpy (in a venv outside the repository)
"""

import argparse
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6, T.Q8_0: 8, T.Q2_K: 2, T.Q3_K: 3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--noise", type=float, default=0.5, help="half-width (uniform) or std-dev (gaussian), in steps")
    ap.add_argument("--dist", choices=["uniform", "gaussian"], default="uniform")
    a = ap.parse_args()
    if os.path.exists(a.out):
        sys.exit(f"{a.out} exists")
    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(a.out + ".part", arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_uint32(name, 1)
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    rng = np.random.default_rng(a.seed)
    total_sq, total_n = {}, {}
    for t in r.tensors:
        qt = T(t.tensor_type)
        shape = [int(x) for x in reversed(t.shape)]  # numpy order (rows, cols)
        if qt in BITS:
            x = gguf.quants.dequantize(t.data, qt).astype(np.float32).reshape(-1, 32)
            step = (x.max(axis=1) - x.min(axis=1)) / float(2 ** BITS[qt] - 1)
            if a.dist == "uniform":
                u = rng.random(x.shape, dtype=np.float32) * 2.0 - 1.0
            else:
                u = rng.standard_normal(x.shape, dtype=np.float32)
            noise = u * (a.noise * step)[:, None]
            total_sq[qt.name] = total_sq.get(qt.name, 0.0) + float((noise.astype(np.float64) ** 2).sum())
            total_n[qt.name] = total_n.get(qt.name, 0) + x.size
            y = (x + noise).reshape(shape)
            out = y.astype(np.float16) if len(shape) >= 2 else y
        else:
            out = gguf.quants.dequantize(t.data, qt).astype(np.float32).reshape(shape)
            if len(shape) >= 2 and qt != T.F32:
                out = out.astype(np.float16)
        w.add_tensor(t.name, out)
        print(f"{t.name}: {qt.name} -> {out.dtype} {shape}", file=sys.stderr)
    for k in total_sq:
        print(f"noise rms over {k} tensors: {np.sqrt(total_sq[k] / total_n[k]):.3e} ({total_n[k]} values)", file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.rename(a.out + ".part", a.out)


if __name__ == "__main__":
    main()
