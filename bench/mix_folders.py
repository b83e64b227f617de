#!/usr/bin/env python3
"""Assemble an eddy model folder from the matrices of other eddy folders of the same model (no rotation).

Without the rotation a matrix's codes depend only on its own values, format and group, so a folder whose
matrices are taken from folders quantized whole in different formats equals what
`eddy quantize --tensor-format RULES` writes for the same rules (round to nearest; with GPTQ also, as the
Hessians come from the float model and do not depend on the other matrices' formats). Used for the
measurements in BENCHMARKS.md (issue 14); the folders must have been written with --no-rotation.

usage: mix_folders.py OUT BASE [RULE ...]     RULE = FOLDER:NAME[@LAYERS]  (LAYERS: 0-4+27, default all)
  every matrix comes from BASE unless a rule names it (the last matching rule wins); NAME as in
  --tensor-format (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, embed_tokens, lm_head).
  Prints the bits per weight (bytes of all 2-D weight tensors with their side tensors, x 8, over their
  weights; as bench/quant_quality.sh counts them).
"""
import json, os, re, shutil, struct, sys

SIDE = (".scales", ".zero_points", ".super_scales", ".super_zero_points", ".high_bits", ".input_signs", ".output_signs")


def header(path):
    f = open(os.path.join(path, "model.safetensors"), "rb")
    n = struct.unpack("<Q", f.read(8))[0]
    h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return f, 8 + n, h


def layers(spec):
    out = set()
    for part in spec.split("+"):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def matches(tensor, name, lay):
    if not tensor.endswith(f"{name}.weight"):
        return False
    if lay is None:
        return True
    m = re.search(r"layers\.(\d+)\.", tensor)
    return m is not None and int(m.group(1)) in lay


def main():
    out, base, rules = sys.argv[1], sys.argv[2], sys.argv[3:]
    srcs = {base: header(base)}
    parsed = []
    for r in rules:
        folder, _, what = r.rpartition(":")
        name, _, lay = what.partition("@")
        srcs.setdefault(folder, header(folder))
        parsed.append((folder, name, layers(lay) if lay else None))
    _, _, hb = srcs[base]
    mats = [k for k in hb if not k.endswith(SIDE)]
    pick = {}
    for k in mats:
        src = base
        for folder, name, lay in parsed:
            if matches(k, name, lay):
                src = folder
        pick[k] = src
    tensors = []  # (name, src, info)
    for k in sorted(mats):
        src = pick[k]
        h = srcs[src][2]
        tensors.append((k, src, h[k]))
        tensors.extend((k + s, src, h[k + s]) for s in SIDE if k + s in h)
    os.makedirs(out + ".tmp", exist_ok=True)
    for fn in os.listdir(base):
        if fn != "model.safetensors":
            shutil.copy(os.path.join(base, fn), os.path.join(out + ".tmp", fn))
    hdr, off = {}, 0
    for name, src, info in tensors:
        n = info["data_offsets"][1] - info["data_offsets"][0]
        hdr[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [off, off + n]}
        off += n
    hj = json.dumps(hdr, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    bits = elems = 0
    with open(os.path.join(out + ".tmp", "model.safetensors"), "wb") as w:
        w.write(struct.pack("<Q", len(hj)))
        w.write(hj)
        for name, src, info in tensors:
            f, start, h = srcs[src]
            a, b = info["data_offsets"]
            f.seek(start + a)
            w.write(f.read(b - a))
            if not name.endswith(SIDE) and len(info["shape"]) == 2:
                rows, cols = info["shape"]
                elems += rows * cols * (2 if info["dtype"] == "U8" and (name + ".zero_points" in h or name + ".high_bits" in h) else 1)
                bits += 8 * ((b - a) + sum(h[name + s]["data_offsets"][1] - h[name + s]["data_offsets"][0] for s in SIDE if name + s in h))
    os.rename(out + ".tmp", out)
    print(f"{bits / elems:.3f}")


main()
