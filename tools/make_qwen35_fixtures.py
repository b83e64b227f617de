#!/usr/bin/env python3
"""Tiny synthetic Qwen3.5 checkpoints (Gated DeltaNet + gated attention) and their transformers logits.

Regenerate (deterministic: fixed seeds, CPU, float32 reference; about 30 s):

    /work/refvenv/bin/python tools/make_qwen35_fixtures.py     # any venv with torch and transformers >= 5.24

Writes crates/eddy/tests/fixtures/qwen35/:
  tiny/          Qwen3_5ForCausalLM, f32, tied embeddings, 4 layers [GDN, GDN, GDN, attention],
                 hidden 32, FFN 64, vocab 256, attention 2/1 heads of 64 (partial RoPE: 16 dims, theta 1e4),
                 GDN 2 key heads x 4 value heads (r = 2) of 16, conv kernel 4
  vl/            Qwen3_5ForConditionalGeneration (text model nested under model.language_model, a one-block
                 vision tower that eddy must skip), f32, untied lm_head, 4 layers [GDN, attention, GDN,
                 attention], GDN 4 key = 4 value heads (r = 1), attention 2/1 heads of 64
  <name>.golden.json   for 3 sequences (random ids; 40, 40 and 90 tokens, so transformers' 64-token chunked
                 GDN crosses a chunk boundary): the tokens, the argmax at every position and the full logits at
                 every position of the first sequence and the last 8 of the others, from
                 transformers' float32 forward without cache (eager attention, chunked GDN).
Every parameter is drawn from seeded normals with std 0.2 (initializer_range >= 0.1, so the logits are far
from flat); zero-centred norms get N(0, 0.2) offsets, the gated GDN norm 1 + N(0, 0.2), A_log = log U(0.05, 1),
dt_bias N(0, 0.5), the depthwise conv N(0, 0.5): decays stay moderate so the recurrent state matters.
The Rust test crates/eddy/tests/qwen35.rs compares eddy against the golden files.
"""

import json
import os
import shutil

import torch
import transformers
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "eddy", "tests", "fixtures", "qwen35")
VOCAB = 256
LENGTHS = [40, 40, 90]
LAST = 8


def text_kwargs(layer_types, heads, kv_heads, k_heads, v_heads, tie):
    return dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, layer_types=layer_types,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
        initializer_range=0.2, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "visual" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            else:  # projections, embeddings, zero-centred norms
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def golden(model, name, text_model_type):
    gen = torch.Generator().manual_seed(1234)
    cases = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (1, n), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        rows = logits if not cases else logits[-LAST:]
        cases.append({"tokens": ids[0].tolist(), "argmax": logits.argmax(-1).tolist(), "first_logit_row": n - len(rows),
                      "logits": [[round(v, 5) for v in row] for row in rows.tolist()]})
    doc = {"generator": f"transformers {transformers.__version__}, torch {torch.__version__}", "model": name,
           "text_model_type": text_model_type, "vocab_size": VOCAB, "cases": cases}
    with open(os.path.join(OUT, f"{name}.golden.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def save(model, name):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)


def main():
    torch.manual_seed(0)
    os.makedirs(OUT, exist_ok=True)
    lin, full = "linear_attention", "full_attention"

    cfg = Qwen3_5TextConfig(**text_kwargs([lin, lin, lin, full], 2, 1, 2, 4, True))
    cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    randomize(model, 1)
    model.tie_weights()
    save(model, "tiny")
    golden(model, "tiny", "qwen3_5_text")

    text = text_kwargs([lin, full, lin, full], 2, 1, 4, 4, False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    randomize(model, 2)
    save(model, "vl")
    golden(model, "vl", "qwen3_5")
    for n in os.listdir(OUT):
        p = os.path.join(OUT, n)
        size = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p)) if os.path.isdir(p) else os.path.getsize(p)
        print(f"{n}: {size} bytes")


if __name__ == "__main__":
    main()
