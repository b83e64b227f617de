#!/usr/bin/env python3
# Generate the GGUF block-type fixtures of crates/eddy/tests/quant_import.rs.
#
# Regenerate (from the repository root):
#     tools/fetch_models.sh smollm2 qwen05 qwen15 gemma3     # real-model cases; see --random-only
#     /work/refvenv/bin/python tools/make_quant_fixtures.py   # any Python with numpy and gguf (gguf-py) >= 0.19
#
# The reference is gguf-py's `gguf.quants.dequantize`, independent of eddy's Rust code. For every type eddy
# imports (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) it writes one case of random
# blocks (random bytes with the f16 scale fields set to finite values: normal ones, one zero, one subnormal,
# negative ones), and for the types found in the real model files a case holding the first rows of a real
# tensor. Output: crates/eddy/tests/fixtures/quant/<type>_<source>.bin, each (little endian):
#     b"EQF1", u32 ggml_type, u32 rows, u32 cols, u32 nbytes, nbytes raw block bytes, rows*cols f32 reference
# (a rows x cols matrix in ggml order: dims = [cols, rows]). Output is deterministic (fixed seed).
import argparse
import os
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/eddy/tests/fixtures/quant"
MODELS = Path(os.environ.get("EDDY_MODELS", Path.home() / ".cache/eddy/models"))

# Byte offsets of the f16 scale fields inside one block.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
# (rows, cols) of the random case of each type.
RANDOM_SHAPE = {T.F32: (4, 64), T.F16: (4, 64), T.BF16: (4, 64)}
for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
    RANDOM_SHAPE[t] = (4, 128)  # 16 blocks
for t in (T.Q4_K, T.Q5_K, T.Q6_K):
    RANDOM_SHAPE[t] = (4, 512)  # 8 super-blocks

# (source name, model file, tensor name, rows to take) of the real-tensor cases.
REAL = [
    ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "blk.0.ffn_down.weight", 2),       # Q4_1
    ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "token_embd.weight", 2),           # Q8_0
    ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "blk.0.attn_norm.weight", 1),      # F32
    ("qwen05", "qwen2.5-coder-0.5b-instruct.gguf", "token_embd.weight", 2),           # Q5_0
    ("qwen05", "qwen2.5-coder-0.5b-instruct.gguf", "blk.0.ffn_down.weight", 1),       # Q6_K
    ("qwen15", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "blk.0.attn_q.weight", 2),  # Q4_K
    ("gemma3", "gemma-3-270m-q4_k_m.gguf", "blk.0.attn_output.weight", 2),            # Q4_K
    ("gemma3", "gemma-3-270m-q4_k_m.gguf", "blk.0.ffn_down.weight", 1),               # Q6_K
]


def reference(raw: np.ndarray, qtype: T, rows: int, cols: int) -> np.ndarray:
    bv, bb = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(rows, cols // bv * bb)
    out = np.asarray(dequantize(blocks, qtype), dtype=np.float32).reshape(rows, cols)
    assert np.all(np.isfinite(out)), qtype.name
    return out


def write_case(name: str, qtype: T, rows: int, cols: int, raw: np.ndarray, ref: np.ndarray) -> int:
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    ref = np.ascontiguousarray(ref, dtype="<f4").reshape(-1)
    assert ref.size == rows * cols
    data = b"EQF1" + struct.pack("<4I", int(qtype), rows, cols, raw.size) + raw.tobytes() + ref.tobytes()
    (OUT / f"{name}.bin").write_bytes(data)
    return len(data)


def random_case(qtype: T, rng: np.random.Generator):
    rows, cols = RANDOM_SHAPE[qtype]
    n = rows * cols
    if qtype == T.F32:
        raw = (rng.standard_normal(n).astype(np.float32) * 3).view(np.uint8)
    elif qtype in (T.F16, T.BF16):
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        exp_mask = 0x7C00 if qtype == T.F16 else 0x7F80
        bits[(bits & exp_mask) == exp_mask] &= ~np.uint16(0x4000)  # no inf/NaN
        raw = bits.view(np.uint8)
    else:
        bv, bb = GGML_QUANT_SIZES[qtype]
        nb = n // bv
        blocks = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
        for off in F16_FIELDS[qtype]:
            v = (rng.standard_normal(nb) * 0.02).astype(np.float16)
            v[0] = 0.0 if off == F16_FIELDS[qtype][0] else v[0]  # a zero scale
            v[1] = np.float16(3e-6) * (1 if off == F16_FIELDS[qtype][0] else -1)  # subnormal f16
            v[2] = np.float16(-abs(float(v[2])) - 1.5)  # a large negative one
            blocks[:, off:off + 2] = v.view(np.uint8).reshape(nb, 2)
        raw = blocks.reshape(-1)
    return rows, cols, raw


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--random-only", action="store_true", help="skip the real-model cases")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.bin"):
        old.unlink()
    rng = np.random.default_rng(20240601)
    total = 0
    for qtype in RANDOM_SHAPE:
        rows, cols, raw = random_case(qtype, rng)
        total += write_case(f"{qtype.name.lower()}_random", qtype, rows, cols, raw,
                            reference(raw, qtype, rows, cols))
    if not args.random_only:
        readers = {}
        for source, fname, tname, take in REAL:
            path = MODELS / fname
            if not path.exists():
                sys.exit(f"{path} is missing: run tools/fetch_models.sh {source} (or pass --random-only)")
            reader = readers.setdefault(fname, GGUFReader(path))
            t = next(t for t in reader.tensors if t.name == tname)
            qtype = T(t.tensor_type)
            cols = int(t.shape[0])
            rows = min(take, int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1)
            bv, bb = GGML_QUANT_SIZES[qtype]
            raw = np.asarray(t.data).view(np.uint8).reshape(-1)[: rows * cols // bv * bb].copy()
            total += write_case(f"{qtype.name.lower()}_{source}", qtype, rows, cols, raw,
                                reference(raw, qtype, rows, cols))
    print(f"wrote {len(list(OUT.glob('*.bin')))} cases, {total} bytes, to {OUT}")


if __name__ == "__main__":
    main()
