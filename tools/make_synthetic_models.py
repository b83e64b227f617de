#!/usr/bin/env python3
"""Tiny random Hugging Face checkpoints (safetensors) and their transformers logits, for eddy's HF-folder loader.

Regenerate (deterministic: fixed seeds, CPU, float32 reference):

    /work/refvenv/bin/python tools/make_synthetic_models.py      # any venv with torch, transformers 5, tokenizers

Writes crates/eddy/tests/fixtures/hf/:
  <arch>/              config.json, model.safetensors, tokenizer.json, tokenizer_config.json (+ chat_template.jinja
                       for llama), saved with save_pretrained(safe_serialization=True), one per architecture:
                         llama   LlamaForCausalLM    f32, tied embeddings, GQA 4/2
                         qwen2   Qwen2ForCausalLM    f32, q/k/v biases, tied embeddings
                         qwen3   Qwen3ForCausalLM    bf16 weights, q/k norms, head_dim 24 != 64/4, untied lm_head
                         gemma3  Gemma3ForCausalLM   f32, layer_types [sliding, full, ...] with sliding_window 8,
                                                     query_pre_attn_scalar 32 != head_dim 16, per-type RoPE with
                                                     linear scaling on full layers, final logit soft-capping
  <arch>.golden.json   for 2 sequences of 40 tokens (one encoded text, one random ids): the tokens, the argmax
                       of the logits at every position and the full logits of the last 8 positions, computed by
                       transformers (eager attention, float32; the bf16 model is reloaded from disk and upcast,
                       so the reference uses exactly the stored bf16 weights). Under "quant": the same model with
                       its matrices rounded as eddy's `--quant q8|q4` rounds them (quantize_f32: q8 symmetric
                       int8 per group of 32; q4 asymmetric int4 per group of 32 for projections, int8 for the
                       embedding/LM head), run by transformers in float32: argmax at every position and the mean
                       KL(reference || quantized) over the last 8 positions.
All parameters, norms included, are drawn from torch.manual_seed-ed normals/uniforms (initializer_range 0.2) so
the logits are far from flat. The tokenizer is a byte-level BPE of 320 tokens trained here with `tokenizers`.
The Rust test crates/eddy/tests/hf_folder.rs compares eddy against the golden files.
"""

import json
import os
import shutil

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "eddy", "tests", "fixtures", "hf")

VOCAB = 320
SEQ_LEN = 40
LAST = 8
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
    "A river flows from the mountains to the sea, carrying stones, sand and the stories of old villages.",
    "In the beginning the engine read the configuration, mapped the weights and tokenized the prompt.",
    "Small models are useful for tests: they load quickly, run in milliseconds and fit in a repository.",
    "fn main() { let x = vec![1, 2, 3]; for v in &x { println!(\"{v}\"); } }",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers like 3.14159, 2.71828 and 1.41421 appear in mathematics, physics and engineering.",
    "She said: \"Hello, world!\" and the whole room answered with laughter and applause.",
]
TEXT = ("The engine maps the weights of a small model, reads its configuration and tokenizer, and then "
        "scores a sentence about a river that flows from the mountains to the sea.")


def train_tokenizer(d):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS * 4, trainer)
    assert tk.get_vocab_size() <= VOCAB
    tk.save(os.path.join(d, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>"}
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    return tk


def randomize(model, gemma_norms):
    """Every parameter drawn afresh: matrices/embeddings/biases N(0, 0.2); norm weights U(0.6, 1.4), or
    N(0, 0.3) for Gemma whose norms apply (1 + w)."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                if gemma_norms:
                    p.normal_(0.0, 0.3)
                else:
                    p.uniform_(0.6, 1.4)
            else:
                p.normal_(0.0, 0.2)


def round_q8(w):
    """eddy's quantize_f32 Q8: per group of 32, s = max|w| / 127, w ~ s * round(w / s)."""
    g = w.reshape(w.shape[0], -1, 32)
    s = g.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.round(g / s).clamp(-127, 127) * s).reshape(w.shape)


def round_q4(w):
    """eddy's quantize_f32 Q4: per group of 32, min m, s = (max - m) / 15, w ~ s * round((w - m) / s) + m."""
    g = w.reshape(w.shape[0], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.round((g - lo) / s).clamp(0, 15) * s + lo).reshape(w.shape)


def quantized_reference(cls, d, kind, seqs, ref_last):
    model = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                vocab_matrix = "embed_tokens" in name or "lm_head" in name
                p.copy_(round_q8(p) if kind == "q8" or vocab_matrix else round_q4(p))
        argmax, kls = [], []
        for toks, ref in zip(seqs, ref_last):
            logits = model(torch.tensor([toks])).logits[0].float()
            argmax.append(logits.argmax(-1).tolist())
            lp, lq = ref.log_softmax(-1), logits[-LAST:].log_softmax(-1)
            kls.append((lp.exp() * (lp - lq)).sum(-1))
    return {"argmax": argmax, "mean_kl_last": torch.cat(kls).mean().item()}


def common(**kw):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, initializer_range=0.2, bos_token_id=1, eos_token_id=2, **kw)


def specs():
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**common(num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=1000.0,
                                                            tie_word_embeddings=True)), torch.float32, False),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common(num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e6,
                                                            tie_word_embeddings=True)), torch.float32, False),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common(num_hidden_layers=3, head_dim=24, rms_norm_eps=1e-6,
                                                            rope_theta=1e6, tie_word_embeddings=False)),
                  torch.bfloat16, False),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**common(
            num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6, final_logit_softcapping=5.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            tie_word_embeddings=True)), torch.float32, True),
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    for i, (arch, (cls, cfg, dtype, gemma)) in enumerate(specs().items()):
        d = os.path.join(OUT, arch)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        tk = train_tokenizer(d)
        if arch == "llama":
            with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(TEMPLATE)
        torch.manual_seed(1000 + i)
        cfg._attn_implementation = "eager"
        model = cls(cfg)
        randomize(model, gemma)
        model.to(dtype).save_pretrained(d, safe_serialization=True)
        for name in os.listdir(d):
            if name == "generation_config.json":
                os.remove(os.path.join(d, name))
            else:
                os.chmod(os.path.join(d, name), 0o644)

        ref = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        text_ids = tk.encode(TEXT).ids
        assert len(text_ids) >= SEQ_LEN, len(text_ids)
        g = torch.Generator().manual_seed(7 + i)
        seqs = [text_ids[:SEQ_LEN], torch.randint(0, VOCAB, (SEQ_LEN,), generator=g).tolist()]
        cases, ref_last = [], []
        for toks in seqs:
            with torch.no_grad():
                logits = ref(torch.tensor([toks])).logits[0].float()
            ref_last.append(logits[-LAST:])
            cases.append({
                "tokens": toks,
                "argmax": logits.argmax(-1).tolist(),
                "last_logits": [[float(f"{v:.7g}") for v in row] for row in logits[-LAST:].tolist()],
            })
        golden = {"generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
                  "arch": arch, "dtype": str(dtype).removeprefix("torch."), "vocab_size": VOCAB, "text": TEXT,
                  "last_positions": LAST, "cases": cases,
                  "quant": {k: quantized_reference(cls, d, k, seqs, ref_last) for k in ("q8", "q4")}}
        with open(os.path.join(OUT, f"{arch}.golden.json"), "w") as f:
            json.dump(golden, f, separators=(",", ":"))
            f.write("\n")
        size = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
        mx = max(abs(v) for c in cases for r in c["last_logits"] for v in r)
        kl = {k: f"{v['mean_kl_last']:.2e}" for k, v in golden["quant"].items()}
        print(f"{arch}: {size / 1024:.0f} KiB, max |logit| {mx:.2f}, quantized-weights KL {kl}, files {sorted(os.listdir(d))}")


if __name__ == "__main__":
    main()
