#!/usr/bin/env python3
"""A synthetic Qwen3.5 with the exact Qwen3.5-0.8B shapes, for eddy's speed and full-size correctness tests.

    python3 tools/make_qwen35_08b.py [DIR]            # numpy only (no torch); ~1 min, 1.5 GB on disk
    /work/refvenv/bin/python tools/make_qwen35_08b.py --golden [DIR]   # needs torch + transformers >= 5.24

The first form writes DIR (default: $EDDY_MODELS or ~/.cache/eddy/models, then qwen35-0.8b-synthetic/):
config.json (Qwen3_5ForCausalLM: 24 layers = 6 x [GDN, GDN, GDN, attention], hidden 1024, FFN 3584,
attention 8/2 heads of 256 with partial RoPE 64 dims, theta 1e7, GDN 16 key / 16 value heads of 128, conv 4,
vocab 248,320, tied embeddings) and model.safetensors (bf16, 0.75 B parameters). The weights are deterministic:
each tensor is drawn from numpy's PCG64 generator seeded with (SEED, tensor index), which numpy keeps stable
within a version; the script refuses other numpy versions than NUMPY (pinned) unless --any-numpy is given.
Matrices and zero-centred norm offsets ~ N(0, 0.1) (initializer_range 0.1, so logits are not flat), GDN gated
norm 1 + N(0, 0.1), A_log = log U(0.05, 1), dt_bias ~ N(0, 0.5), conv ~ N(0, 0.5).

The --golden form loads DIR with transformers (float32 compute on the stored bf16 values) and writes
crates/eddy/tests/fixtures/qwen35/08b.golden.json: for 2 sequences of 32 random token ids, the argmax and
the top-16 (id, logit) at every position, plus a fingerprint of the weights (a few values of chosen tensors)
that the Rust test checks before comparing, so stale weights are reported as such.
"""

import json
import os
import sys

import numpy as np

NUMPY = "2.4.6"
SEED = 20260
NAME = "qwen35-0.8b-synthetic"
H, F, L, V = 1024, 3584, 24, 248320
NH, NKV, HD = 8, 2, 256
KH, VH, DK, DV, K = 16, 16, 128, 128, 4
CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": V, "hidden_size": H,
    "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV,
    "head_dim": HD, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": True, "attention_bias": False, "full_attention_interval": 4,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)],
    "linear_conv_kernel_dim": K, "linear_key_head_dim": DK, "linear_value_head_dim": DV,
    "linear_num_key_heads": KH, "linear_num_value_heads": VH, "initializer_range": 0.1, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
FINGERPRINT = [("model.embed_tokens.weight", 0), ("model.embed_tokens.weight", 123456789),
               ("model.layers.23.mlp.down_proj.weight", 777), ("model.layers.0.linear_attn.A_log", 3)]


def tensors():
    """(name, shape, kind) in file order; kind picks the distribution."""
    out = [("model.embed_tokens.weight", (V, H), "w")]
    for l in range(L):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (H,), "w"), (p + "post_attention_layernorm.weight", (H,), "w")]
        if CONFIG["layer_types"][l] == "full_attention":
            a = p + "self_attn."
            out += [(a + "q_proj.weight", (2 * NH * HD, H), "w"), (a + "k_proj.weight", (NKV * HD, H), "w"),
                    (a + "v_proj.weight", (NKV * HD, H), "w"), (a + "o_proj.weight", (H, NH * HD), "w"),
                    (a + "q_norm.weight", (HD,), "w"), (a + "k_norm.weight", (HD,), "w")]
        else:
            g = p + "linear_attn."
            cd = 2 * KH * DK + VH * DV
            out += [(g + "in_proj_qkv.weight", (cd, H), "w"), (g + "in_proj_z.weight", (VH * DV, H), "w"),
                    (g + "in_proj_b.weight", (VH, H), "w"), (g + "in_proj_a.weight", (VH, H), "w"),
                    (g + "conv1d.weight", (cd, 1, K), "conv"), (g + "A_log", (VH,), "alog"),
                    (g + "dt_bias", (VH,), "dt"), (g + "norm.weight", (DV,), "one"),
                    (g + "out_proj.weight", (H, VH * DV), "w")]
        m = p + "mlp."
        out += [(m + "gate_proj.weight", (F, H), "w"), (m + "up_proj.weight", (F, H), "w"),
                (m + "down_proj.weight", (H, F), "w")]
    out.append(("model.norm.weight", (H,), "w"))
    return out


def draw(index, shape, kind):
    rng = np.random.default_rng([SEED, index])
    n = int(np.prod(shape))
    if kind == "alog":
        return np.log(rng.uniform(0.05, 1.0, n)).astype(np.float32)
    x = rng.standard_normal(n, dtype=np.float32)
    if kind == "w":
        x *= 0.1
    elif kind in ("conv", "dt"):
        x *= 0.5
    elif kind == "one":
        x = 1.0 + 0.1 * x
    return x


def to_bf16(x):
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def default_dir():
    base = os.environ.get("EDDY_MODELS") or os.path.join(os.path.expanduser("~"), ".cache", "eddy", "models")
    return os.path.join(base, NAME)


def generate(d):
    os.makedirs(d, exist_ok=True)
    ts = tensors()
    header, off = {}, 0
    for name, shape, _ in ts:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    tmp = os.path.join(d, "model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for i, (name, shape, kind) in enumerate(ts):
            f.write(to_bf16(draw(i, shape, kind)).tobytes())
    os.replace(tmp, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    print(f"wrote {d}: {off / 1e9:.2f} GB of bf16 weights, {sum(int(np.prod(s)) for _, s, _ in ts) / 1e9:.3f} B parameters")


def golden(d):
    import torch
    import transformers
    from transformers import Qwen3_5ForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    sd = model.state_dict()
    fp = [{"tensor": n, "index": i, "value": float(sd[n].flatten()[i])} for n, i in FINGERPRINT]
    gen = torch.Generator().manual_seed(42)
    cases = []
    for _ in range(2):
        ids = torch.randint(0, V, (1, 32), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        top = logits.topk(16, dim=-1)
        cases.append({"tokens": ids[0].tolist(), "argmax": logits.argmax(-1).tolist(),
                      "top_ids": top.indices.tolist(),
                      "top_logits": [[round(v, 5) for v in r] for r in top.values.tolist()],
                      "max_abs_logit": float(logits.abs().max())})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(root, "crates", "eddy", "tests", "fixtures", "qwen35", "08b.golden.json")
    with open(out, "w") as f:
        json.dump({"generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
                   "model": NAME, "fingerprint": fp, "cases": cases}, f, separators=(",", ":"))
    print(f"wrote {out}")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    d = args[0] if args else default_dir()
    if "--golden" in sys.argv:
        golden(d)
        return
    if np.__version__ != NUMPY and "--any-numpy" not in sys.argv:
        sys.exit(f"numpy {np.__version__} found; the weights are pinned to numpy {NUMPY} "
                 f"(pip install numpy=={NUMPY}, or pass --any-numpy and regenerate the golden file)")
    generate(d)


if __name__ == "__main__":
    main()
