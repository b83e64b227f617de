#!/usr/bin/env python3
"""Tiny DFlash drafter and its reference outputs, for crates/eddy/tests/dflash.rs.

Writes crates/eddy/tests/fixtures/dflash/tiny/{config.json, model.safetensors} (a DFlash drafter in the
Hugging Face format of z-lab/SpecForge drafters, random seeded f32 weights) and reference.safetensors
(a random target embedding and LM head, random target features for two rounds, the two roots, and the
block logits this script computes for them). numpy only: the forward pass below is written from the
equations of z-lab's `dflash/model.py` (docs/dflash.md), in float64:

    c = hidden_norm(fc . features)                         # context rows, positions 0..n-1
    x = embed([root, MASK x (B-1)])                        # block rows, positions n..n+B-1
    per layer: h = input_layernorm(x); q = q_norm(Wq h); K = k_norm(Wk [c; h]); V = Wv [c; h]
               rope (rotate-half) at absolute positions; every block row attends to all rows
               x += Wo attn;  x += Wdown(silu(Wgate h') * Wup h'),  h' = post_attention_layernorm(x)
    logits = lm_head . norm(x)[1:]                         # slot k predicts the token at n + k

Round 1: context = features of positions 0..8, root at 9. Round 2: three more context rows (positions
9..11, as after a verify step that accepted two drafts), root at 12; the reference recomputes everything
from scratch, so the test checks eddy's cached context K/V too.

Run: python3 tools/make_dflash_fixture.py   (numpy; deterministic)
"""
import json
import os
import struct

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "eddy", "tests", "fixtures", "dflash")

CFG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 256,
    "hidden_act": "silu",
    "attention_bias": False,
    "block_size": 16,
    "num_target_layers": 5,
    "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 3]},
}


def save_safetensors(path, tensors):
    """Minimal safetensors writer (little-endian, 8-byte header length, JSON header, raw data)."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dtype = {np.float32: "F32", np.int32: "I32"}[arr.dtype.type]
        b = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x: (T, heads, hd), rotate-half RoPE at positions pos (T,)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def forward(w, c, feats, root, embed, lm_head):
    d, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, theta, b = c["rms_norm_eps"], c["rope_theta"], c["block_size"]
    mask = c["dflash_config"]["mask_token_id"]
    n = feats.shape[0]
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[[root] + [mask] * (b - 1)].copy()
    pos_blk = np.arange(n, n + b)
    pos_all = np.arange(0, n + b)
    for l in range(c["num_hidden_layers"]):
        p = lambda s: w[f"layers.{l}.{s}"]
        h = rms(x, p("input_layernorm.weight"), eps)
        q = rms((h @ p("self_attn.q_proj.weight").T).reshape(b, nh, hd), p("self_attn.q_norm.weight"), eps)
        kin = np.concatenate([ctx, h], axis=0)
        k = rms((kin @ p("self_attn.k_proj.weight").T).reshape(n + b, nkv, hd), p("self_attn.k_norm.weight"), eps)
        v = (kin @ p("self_attn.v_proj.weight").T).reshape(n + b, nkv, hd)
        q, k = rope(q, pos_blk, theta), rope(k, pos_all, theta)
        att = np.zeros((b, nh, hd))
        for hh in range(nh):
            kv = hh // (nh // nkv)
            s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hh, :] = s @ v[:, kv, :]
        x = x + att.reshape(b, nh * hd) @ p("self_attn.o_proj.weight").T
        h2 = rms(x, p("post_attention_layernorm.weight"), eps)
        g = h2 @ p("mlp.gate_proj.weight").T
        u = h2 @ p("mlp.up_proj.weight").T
        x = x + ((g / (1.0 + np.exp(-g))) * u) @ p("mlp.down_proj.weight").T
    return rms(x, w["norm.weight"], eps)[1:] @ lm_head.T


def main():
    rng = np.random.default_rng(20261201)
    c = CFG
    d, nh, nkv, hd, f = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]
    nsel = len(c["dflash_config"]["target_layer_ids"])
    vocab = c["vocab_size"]

    def mat(r, k, scale=None):
        return rng.standard_normal((r, k)) * (scale if scale is not None else 1.0 / np.sqrt(k))

    def norm(n):
        return 1.0 + 0.2 * rng.standard_normal(n)

    w = {"fc.weight": mat(d, nsel * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for l in range(c["num_hidden_layers"]):
        p = f"layers.{l}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(nh * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * hd, d)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * hd, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, nh * hd)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = mat(f, d)
        w[p + "mlp.up_proj.weight"] = mat(f, d)
        w[p + "mlp.down_proj.weight"] = mat(d, f)
    # Store f32 and compute the reference from exactly the stored values.
    w = {k: v.astype(np.float32) for k, v in w.items()}
    embed = rng.standard_normal((vocab, d)).astype(np.float32)
    lm_head = (rng.standard_normal((vocab, d)) / np.sqrt(d) * 4.0).astype(np.float32)
    feats1 = (rng.standard_normal((9, nsel * d)) * 2.0).astype(np.float32)
    feats2 = (rng.standard_normal((3, nsel * d)) * 2.0).astype(np.float32)
    roots = np.array([17, 42], dtype=np.int32)
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    e64, h64 = embed.astype(np.float64), lm_head.astype(np.float64)
    logits1 = forward(w64, c, feats1.astype(np.float64), int(roots[0]), e64, h64)
    all_feats = np.concatenate([feats1, feats2], axis=0).astype(np.float64)
    logits2 = forward(w64, c, all_feats, int(roots[1]), e64, h64)

    tiny = os.path.join(OUT, "tiny")
    os.makedirs(tiny, exist_ok=True)
    with open(os.path.join(tiny, "config.json"), "w") as fh:
        json.dump(c, fh, indent=2)
        fh.write("\n")
    save_safetensors(os.path.join(tiny, "model.safetensors"), w)
    save_safetensors(
        os.path.join(OUT, "reference.safetensors"),
        {
            "embed": embed,
            "lm_head": lm_head,
            "features1": feats1,
            "features2": feats2,
            "roots": roots,
            "logits1": logits1.astype(np.float32),
            "logits2": logits2.astype(np.float32),
        },
    )
    print("wrote", tiny, "and reference.safetensors; logits1[0,:4] =", logits1[0, :4])


if __name__ == "__main__":
    main()
