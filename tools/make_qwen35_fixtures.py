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
  tiny/ also holds random `mtp.*` weights (one MTP head: norms, fc, a full-attention layer, norm; vLLM's
                 layout), which transformers ignores; tiny.mtp.golden.json has the MTP head's logits for one
                 sequence, computed here from transformers' modules (see add_mtp)
  <name>.golden.json   for 3 sequences (random ids; 40, 40 and 90 tokens, so transformers' 64-token chunked
                 GDN crosses a chunk boundary): the tokens, the argmax at every position and the full logits at
                 every position of the first sequence and the last 8 of the others, and under "quant" what
                 eddy's --quant q8|q4 rounding costs when simulated in transformers (see quant_reference), from
                 transformers' float32 forward without cache (eager attention, chunked GDN).
Every parameter is drawn from seeded normals with std 0.2 (initializer_range >= 0.1, so the logits are far
from flat); zero-centred norms get N(0, 0.2) offsets, the gated GDN norm 1 + N(0, 0.2), A_log = log U(0.05, 1),
dt_bias N(0, 0.5), the depthwise conv N(0, 0.5): decays stay moderate so the recurrent state matters.
The Rust test crates/eddy/tests/qwen35.rs compares eddy against the golden files.
"""

import copy
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


def round_groups(w, kind):
    """eddy's quantize_f32 rounding per group of 32 along rows: q8 symmetric int8, q4 asymmetric int4."""
    r, c = w.shape
    g = w.reshape(r, c // 32, 32)
    if kind == "q8":
        s = g.abs().amax(-1, keepdim=True) / 127
        return (torch.round(g / s.clamp(min=1e-30)) * s).reshape(r, c)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    return (torch.round((g - lo) / s.clamp(min=1e-30)).clamp(0, 15) * s + lo).reshape(r, c)


def quant_reference(model, cases):
    """What `--quant q8|q4` should cost on this model: transformers with every matrix rounded as eddy rounds
    it (q4: projections int4, embedding/LM head int8) and every matrix input rounded to int8 per group of 32
    (eddy's activations); mean KL(f32 || rounded) and argmax agreement over all positions."""
    out = {}
    ids = [torch.tensor([c["tokens"]]) for c in cases]
    with torch.no_grad():
        ref = [model(input_ids=i, use_cache=False).logits[0] for i in ids]
    for kind in ("q8", "q4"):
        m = copy.deepcopy(model)
        hooks = []
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.ndim == 2 and p.shape[1] % 32 == 0 and "visual" not in n:
                    vocab = "embed" in n or "lm_head" in n
                    p.copy_(round_groups(p, "q8" if vocab else kind))
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear) and mod.in_features % 32 == 0:
                hooks.append(mod.register_forward_pre_hook(lambda _m, a: (round_groups(a[0].reshape(-1, a[0].shape[-1]), "q8").reshape(a[0].shape),)))
        with torch.no_grad():
            got = [m(input_ids=i, use_cache=False).logits[0] for i in ids]
        kl = sum(torch.nn.functional.kl_div(o.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="none").sum().item()
                 for o, r in zip(got, ref)) / sum(r.shape[0] for r in ref)
        agree = sum((o.argmax(-1) == r.argmax(-1)).sum().item() for o, r in zip(got, ref))
        out[kind] = {"mean_kl": kl, "argmax_agree": agree, "positions": sum(r.shape[0] for r in ref)}
    return out


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
           "text_model_type": text_model_type, "vocab_size": VOCAB, "cases": cases,
           "quant": quant_reference(model, cases)}
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


def add_mtp(model, name, seed):
    """Random `mtp.*` weights (vLLM's Qwen3.5 MTP layout) appended to <name>/model.safetensors, and the MTP
    head's logits computed here with transformers' own modules: for a sequence x_0..x_{T-1}, step t (t < T-1)
    feeds e_t = embed(x_{t+1}) and h_t = the final-normed hidden state at t through
    norm_e(e) ++ norm_h(h) -> fc -> one full-attention decoder layer (own causal attention over t = 0..T-2,
    positions 0..T-2) -> mtp.norm -> lm_head."""
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                             Qwen3_5TextRotaryEmbedding)
    cfg = model.config.get_text_config()
    h = cfg.hidden_size
    mcfg = copy.deepcopy(cfg)
    mcfg.num_hidden_layers, mcfg.layer_types = 1, ["full_attention"]
    mcfg._attn_implementation = "eager"
    mtp = torch.nn.ModuleDict({
        "pre_fc_norm_embedding": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * h, h, bias=False),
        "layers": torch.nn.ModuleList([Qwen3_5DecoderLayer(mcfg, 0)]),
        "norm": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
    }).float().eval()
    randomize(mtp, seed)
    path = os.path.join(OUT, name, "model.safetensors")
    tensors = load_file(path)
    tensors.update({f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, path, metadata={"format": "pt"})

    gen = torch.Generator().manual_seed(4321)
    ids = torch.randint(0, VOCAB, (1, 40), generator=gen)
    with torch.no_grad():
        base = model.model.language_model if hasattr(model.model, "language_model") else model.model
        hidden = base(input_ids=ids).last_hidden_state[:, :-1]
        emb = base.embed_tokens(ids[:, 1:])
        z = mtp["fc"](torch.cat([mtp["pre_fc_norm_embedding"](emb), mtp["pre_fc_norm_hidden"](hidden)], dim=-1))
        t = z.shape[1]
        pos = torch.arange(t).view(1, 1, -1).expand(3, 1, -1)
        cos_sin = Qwen3_5TextRotaryEmbedding(mcfg)(z, pos)
        mask = torch.full((t, t), float("-inf")).triu(1).view(1, 1, t, t)
        z = mtp["layers"][0](z, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos[0])
        logits = model.lm_head(mtp["norm"](z))[0].float()
    return {"tokens": ids[0].tolist(), "argmax": logits.argmax(-1).tolist(), "first_logit_row": t - LAST,
            "logits": [[round(v, 5) for v in row] for row in logits[-LAST:].tolist()]}


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
    mtp = add_mtp(model, "tiny", 3)
    with open(os.path.join(OUT, "tiny.mtp.golden.json"), "w") as f:
        json.dump(mtp, f, separators=(",", ":"))

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
