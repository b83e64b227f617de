#!/usr/bin/env python3
"""Reference logits and perplexities from Hugging Face transformers for eddy's model tests.

transformers loads the same GGUF files eddy loads, dequantized to f32; that is the independent reference.
For each model and prompt it records, teacher-forced over the prompt's tokens, per position: the top-20
logits (ids and values) and the log-sum-exp of the whole row. It also records the perplexity of
tools/data/ppl_sample.txt computed as `eddy perplexity` computes it (non-overlapping windows of CTX tokens,
tokens 1..n-1 of each window scored, BOS only if the tokenizer adds one).

Regenerate (needs torch, transformers, gguf, accelerate; about 10 minutes on 2 cores):
    python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch transformers gguf accelerate
    tools/fetch_models.sh smollm2 qwen05 gemma3
    /tmp/refvenv/bin/python tools/make_logit_fixtures.py   # writes crates/eddy/tests/fixtures/logits/*.json
"""
import json, math, os, sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("EDDY_MODELS", Path.home() / ".cache/eddy/models"))
OUT = ROOT / "crates/eddy/tests/fixtures/logits"
N_POS = 64
TOPK = 20
PPL_CTX = 128

PROMPTS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    i, j = 0, 0\n    out = []\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n\n"
    "if __name__ == \"__main__\":\n    print(merge_sorted([1, 4, 9], [2, 3, 10, 11]))\n",
    "The river bends twice before it reaches the old mill. In spring the water rises over the stones, and the "
    "children from the village come down to watch the wheel turn. Their grandparents remember when the mill "
    "still ground flour for three valleys, and every autumn the carts lined up along the road waiting their turn. "
    "Now the stones are quiet, and only the swallows use the loft.",
    "<|im_start|>user\nWhat does this JSON describe?\n{\"name\": \"eddy\", \"language\": \"Rust\", \"backends\": [\"cpu\", \"cuda\"], "
    "\"version\": \"0.1.0\"}<|im_end|>\n<|im_start|>assistant\nIt describes a software project called eddy, written in Rust, "
    "with two backends: one for the CPU and one for CUDA GPUs. The version field says it is an early release.<|im_end|>\n",
]

MODEL_FILES = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen05": "qwen2.5-coder-0.5b-instruct.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    names = sys.argv[1:] or list(MODEL_FILES)
    text = (ROOT / "tools/data/ppl_sample.txt").read_text()
    for name in names:
        f = MODEL_FILES[name]
        tok = AutoTokenizer.from_pretrained(MODELS, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(MODELS, gguf_file=f, torch_dtype=torch.float32)
        model.eval()
        cases = []
        for p in PROMPTS:
            ids = tok(p, add_special_tokens=True)["input_ids"][:N_POS]
            assert len(ids) == N_POS, (name, len(ids))
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].double()
            lse = torch.logsumexp(logits, -1)
            top = torch.topk(logits, TOPK, -1)
            cases.append({
                "prompt": p,
                "tokens": ids,
                "top_ids": top.indices.tolist(),
                "top_logits": [[round(v, 5) for v in row] for row in top.values.tolist()],
                "lse": [round(v, 6) for v in lse.tolist()],
            })
        # Perplexity the way eddy perplexity computes it.
        ids = tok(text, add_special_tokens=True)["input_ids"]
        nll, n = 0.0, 0
        for s in range(0, len(ids), PPL_CTX):
            w = ids[s:s + PPL_CTX]
            if len(w) < 2:
                continue
            with torch.no_grad():
                lg = model(torch.tensor([w])).logits[0].double()
            lp = torch.log_softmax(lg, -1)
            for i in range(len(w) - 1):
                nll -= lp[i, w[i + 1]].item()
                n += 1
        fixture = {
            "model_file": f,
            "transformers": __import__("transformers").__version__,
            "cases": cases,
            "perplexity": {"ctx": PPL_CTX, "text_file": "tools/data/ppl_sample.txt", "ppl": math.exp(nll / n), "scored": n},
        }
        (OUT / f"{name}.json").write_text(json.dumps(fixture))
        print(name, "ppl", math.exp(nll / n), "scored", n, flush=True)


if __name__ == "__main__":
    main()
