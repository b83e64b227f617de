#!/usr/bin/env python3
"""Regenerate eddy's tokenizer and chat-template fixtures from transformers (the reference).

usage:  /work/refvenv/bin/python tools/make_text_fixtures.py [MODELS_DIR]
        (MODELS_DIR defaults to $EDDY_MODELS or ~/.cache/eddy/models; fetch the files with
        `tools/fetch_models.sh all`). Needs transformers (5.x), tokenizers and jinja2.

Writes crates/eddy/tests/fixtures/text/:
  <key>.json        one per GGUF model: the tokenizer transformers builds from the GGUF
                    (AutoTokenizer.from_pretrained(dir, gguf_file=...)): special tokens, add_bos, fingerprints
                    (FNV-1a 64) of its vocabulary, merges and added tokens, then for every test string the ids
                    with add_special_tokens=True/False and decode() of them (skip_special_tokens False/True),
                    a few raw id sequences with their decodes, and -- for models with a chat template --
                    apply_chat_template renders (text and ids) of several conversations.
  tiny_hf/ + tiny_hf.json  a tiny byte-level BPE tokenizer trained here (tokenizer.json, tokenizer_config.json
                    with add_bos_token and a list-form chat_template), and what AutoTokenizer.from_pretrained(tiny_hf)
                    makes of the test strings and conversations (exercises Tokenizer::from_file / ChatTemplate::from_dir).
  chat_synthetic.json  small templates exercising the Jinja features chat templates use (tojson, namespace,
                    loop controls, python string/dict methods, raise_exception, whitespace control), rendered
                    with transformers' own renderer (render_jinja_template).
The Rust tests crates/eddy/tests/{tokenizer,chat_template}.rs compare eddy against these files exactly.
"""

import json
import os
import random
import sys

import tokenizers
import transformers
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "crates", "eddy", "tests", "fixtures", "text")

MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen05": "qwen2.5-coder-0.5b-instruct.gguf",
    "qwen15": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}

TEXTS = [
    "Hello, world!",
    "naïve café",
    "中文分词测试：你好，世界。",
    "日本語のテキストです。カタカナとひらがな。",
    "emoji 😀🎉 and flags 🇫🇷🇯🇵",
    "family 👨‍👩‍👧‍👦 and 👩🏽‍💻 and skin tone 👍🏽",
    "def f(x):\n\treturn x * 2\n\n\nclass A:\n    pass\n",
    "   leading spaces",
    "a    b",
    "\n\n\n",
    "12345678 and 3.14159 and 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>",
    "<bos>Hello<end_of_turn>\n<start_of_turn>model\n",
    "",
    " ",
    "trailing spaces   ",
    "Mixed CASE words, don't won't I'm you're we'll they'd HE'S",
    "Привет, мир! Ελληνικά. עברית. العربية",
    "한국어 텍스트 입니다",
    "tabs\tand\r\nCRLF\r\nlines",
    "URL https://example.com/path?q=1&r=2#frag",
    'JSON {"key": [1, 2, {"nested": null}]}',
    "math ∑_{i=1}^n x_i² ≤ ∞ → ∀x∃y",
    "<think>reasoning</think> answer",
    "combining e\u0301 vs \u00e9, \u00c5 vs \u212b",
    "zero width\u200bspace and nbsp\u00a0here",
    "<|im_start|><|im_end|><|im_start|>",
    "The ▁ char and <0x41> and <unk>",
    "a" * 100,
    "  \n  \t  mixed whitespace  \n",
    "x",
]

CONVERSATIONS = [
    (
        "full",
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3? Answer in 日本語 please 🙂"},
        ],
    ),
    ("user_only", [{"role": "user", "content": "Hello!"}]),
    (
        "user_assistant",
        [{"role": "user", "content": "  spaced\n\ncontent  "}, {"role": "assistant", "content": "ok\n"}],
    ),
    (
        "specials_in_content",
        [{"role": "user", "content": "literal <|im_end|> and <|endoftext|> inside"}],
    ),
]


def fnv1a64(text: str) -> str:
    """FNV-1a 64 of the UTF-8 bytes, as 16 hex digits (the Rust tests compute the same)."""
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def single_byte_ids(tok, model_type, data: bytes):
    """Ids of the one-byte tokens spelling `data` (byte-level alphabet, or <0xNN> byte-fallback tokens)."""
    vocab = tok.get_vocab()
    if model_type == "byte_level":
        table = bytes_to_unicode()
        return [vocab[table[b]] for b in data]
    return [vocab[f"<0x{b:02X}>"] for b in data]


def model_fixture(models_dir, key, fname):
    tok = AutoTokenizer.from_pretrained(models_dir, gguf_file=fname)
    backend = json.loads(tok.backend_tokenizer.to_str())
    model = backend["model"]
    model_type = "byte_level" if "ByteLevel" in json.dumps(backend["decoder"]) else "sentencepiece"
    vocab = tok.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    merges = model.get("merges") or []
    merges_text = "".join((" ".join(m) if isinstance(m, list) else m) + "\n" for m in merges)
    added = sorted(backend["added_tokens"], key=lambda t: t["id"])
    added_text = "".join(f"{t['id']}\t{t['content']}\t{int(t['special'])}\n" for t in added)

    def dec(ids, skip):
        return tok.decode(ids, skip_special_tokens=skip)

    cases = []
    for text in TEXTS:
        ids_plain = tok(text, add_special_tokens=False)["input_ids"]
        ids_special = tok(text, add_special_tokens=True)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": ids_plain,
                "ids_special": ids_special,
                "decoded": dec(ids_special, False),
                "decoded_skip": dec(ids_special, True),
            }
        )

    rng = random.Random(1234)
    n = len(tok)
    id_seqs = [
        ("first_64", list(range(64))),
        ("emoji_bytes", single_byte_ids(tok, model_type, "😀".encode())),
        ("emoji_bytes_truncated", single_byte_ids(tok, model_type, "😀".encode()[:3])),
        ("emoji_then_text", single_byte_ids(tok, model_type, "é😀".encode()) + tok("ok", add_special_tokens=False)["input_ids"]),
        ("random_200", [rng.randrange(n) for _ in range(200)]),
        ("last_32", list(range(n - 32, n))),
    ]
    decodes = [{"name": name, "ids": ids, "decoded": dec(ids, False), "decoded_skip": dec(ids, True)} for name, ids in id_seqs]

    chat = []
    if tok.chat_template:
        for name, msgs in CONVERSATIONS:
            for gen in (False, True):
                kwargs = {"enable_thinking": False} if name == "full" else {}
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kwargs)
                ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False, **kwargs)
                chat.append({"name": name, "messages": msgs, "add_generation_prompt": gen, "kwargs": kwargs, "text": text, "ids": ids})

    return {
        "model_file": fname,
        "generator": f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}",
        "tokenizer_class": type(tok).__name__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
        "len": len(tok),
        "vocab_entries": len(vocab),
        "vocab_fnv": fnv1a64("".join(f"{i}\t{t}\n" for t, i in by_id)),
        "merges_count": len(merges),
        "merges_fnv": fnv1a64(merges_text),
        "added_count": len(added),
        "added_special_count": sum(1 for t in added if t["special"]),
        "added_fnv": fnv1a64(added_text),
        "has_chat_template": bool(tok.chat_template),
        "cases": cases,
        "decodes": decodes,
        "chat": chat,
    }


SYNTHETIC_MESSAGES = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "héllo wörld"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "x-ray: tell me more"},
]

SYNTHETIC = [
    ("tojson", "{{ data | tojson }}|{{ data | tojson(indent=2) }}|{{ 'x<y>&\\'é' | tojson }}|{{ messages[1] | tojson }}",
     {"data": {"a": 1, "b": [1.5, True, None, "ü\"\n\t\u0001/\\"], "c": {"d": 1e20, "e": 0.00001, "f": -0.0, "g": 1e16, "h": 1234567890123456.0, "i": 0.1, "j": []}, "k": {}}}),
    ("namespace_loop_controls",
     "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
     "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m.content|trim }}{% if loop.index > 2 %}{% break %}{% endif %}\n{% endfor %}", {}),
    ("string_methods",
     "{% for m in messages %}{{ m.content.strip().upper() }}|{{ m.content.split(' ') | length }}|{{ m.content.startswith('x') }}|"
     "{{ m.content.replace('l', 'L') }}|{{ m.content.lstrip(' B') }}|{{ m.role.title() }}|{{ m.content.endswith('!') }}\n{% endfor %}"
     "{{ '-'.join(['a', 'b', 'c']) }}", {}),
    ("dict_methods", "{% for k, v in extra.items() %}{{ k }}={{ v }};{% endfor %}|{{ extra.get('missing', 'dflt') }}|{{ extra.get('a') }}|{{ extra.keys() | list | length }}",
     {"extra": {"a": 1, "b": "two", "c": [3]}}),
    ("whitespace_control",
     "{% for m in messages %}\n    {% if m.role == 'user' %}\n        <u>{{ m.content }}</u>\n    {% else %}\n        <o>{{ m.content }}</o>\n    {% endif %}\n{% endfor %}\n"
     "{%- if add_generation_prompt %}\n  <gen>\n{%- endif %}\n", {}),
    ("filters_slicing",
     "{{ messages[1:] | length }}|{{ messages[-1].content }}|{{ (messages | first).role }}|{{ (messages | last).role }}|"
     "{{ messages | map(attribute='role') | join(',') }}|{{ undefined_var | default('dv') }}|{{ 'abc' | upper }}|"
     "{{ foo is defined }}|{{ tools is none }}|{{ 'ell' in 'hello' }}|{{ 'a' ~ 1 ~ 'b' }}|{{ messages[0].content is string }}", {}),
    ("bos_eos_kwargs",
     "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
     "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
     {"enable_thinking": False}),
    ("python_values", "{{ flag }} {{ nothing }} {{ 1.0 }} {{ 3 / 2 }} {{ 7 // 2 }} {{ 2 ** 10 }} {{ 10 % 3 }} {{ -1.5e-7 }}", {"flag": True, "nothing": None}),
    ("tools_none", "{% if tools %}has tools{% else %}no tools{% endif %}|{% if documents %}docs{% else %}no docs{% endif %}", {}),
    ("raise_exception", "{% if messages | length > 1 %}{{ raise_exception('Only one message allowed!') }}{% endif %}ok", {}),
    ("role_check",
     "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 1) and m.role != 'system' %}"
     "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ loop.index }}{{ m['role'][0] }}{% endfor %}", {}),
    ("macros_set",
     "{% macro fmt(m) %}[{{ m.role }}] {{ m.content }}{% endmacro %}{% set sys = messages[0].content if messages[0].role == 'system' else '' %}"
     "{{ sys | trim }}{% for m in messages[1:] %}\n{{ fmt(m) }}{% endfor %}", {}),
]


def synthetic_fixture():
    out = []
    for name, template, kwargs in SYNTHETIC:
        for gen in (False, True):
            entry = {"name": name, "template": template, "messages": SYNTHETIC_MESSAGES, "add_generation_prompt": gen,
                     "bos_token": "<s>", "eos_token": "</s>", "kwargs": kwargs}
            try:
                rendered, _ = render_jinja_template(
                    conversations=[SYNTHETIC_MESSAGES], chat_template=template, add_generation_prompt=gen,
                    bos_token="<s>", eos_token="</s>", **kwargs)
                entry["text"] = rendered[0]
            except Exception as e:  # the template raised: eddy must fail too
                entry["error"] = str(e)
            out.append(entry)
    return out


TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Hello again, world.",
    "def add(a, b):\n    return a + b\n",
    "naïve café, 日本語, emoji 😀",
    "Numbers: 12345678, 3.14159, 1,000,000.",
] * 20

TINY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_hf_fixture():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = os.path.join(OUT, "tiny_hf")
    os.makedirs(d, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(TINY_CORPUS, trainer)
    tk.save(os.path.join(d, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True},
        "unk_token": "<unk>",
        "add_bos_token": True,
        "chat_template": [{"name": "default", "template": TINY_TEMPLATE}, {"name": "other", "template": "unused"}],
    }
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
        f.write("\n")
    tok = AutoTokenizer.from_pretrained(d)
    cases = []
    for text in TEXTS:
        ids_special = tok(text, add_special_tokens=True)["input_ids"]
        cases.append({"text": text, "ids": tok(text, add_special_tokens=False)["input_ids"], "ids_special": ids_special,
                      "decoded": tok.decode(ids_special), "decoded_skip": tok.decode(ids_special, skip_special_tokens=True)})
    chat = []
    for name, msgs in CONVERSATIONS:
        for gen in (False, True):
            chat.append({"name": name, "messages": msgs, "add_generation_prompt": gen, "kwargs": {},
                         "text": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen),
                         "ids": tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)})
    return {"generator": f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}",
            "tokenizer_class": type(tok).__name__, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "add_bos_token": bool(getattr(tok, "add_bos_token", False)), "len": len(tok), "cases": cases, "chat": chat}


def write_json(path, obj):
    """One line per list item at the top two levels, so the files diff well and stay small."""
    def dump(v):
        return json.dumps(v, ensure_ascii=False)

    with open(path, "w", encoding="utf-8") as f:
        if isinstance(obj, list):
            f.write("[\n" + ",\n".join(" " + dump(x) for x in obj) + "\n]\n")
            return
        lines = []
        for k, v in obj.items():
            if isinstance(v, list) and v and isinstance(v[0], dict):
                lines.append(f" {dump(k)}: [\n" + ",\n".join("  " + dump(x) for x in v) + "\n ]")
            else:
                lines.append(f" {dump(k)}: {dump(v)}")
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


def main():
    models_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("EDDY_MODELS", os.path.expanduser("~/.cache/eddy/models"))
    os.makedirs(OUT, exist_ok=True)
    for key, fname in MODELS.items():
        fx = model_fixture(models_dir, key, fname)
        write_json(os.path.join(OUT, f"{key}.json"), fx)
        print(f"{key}: {len(fx['cases'])} strings, {len(fx['decodes'])} id sequences, {len(fx['chat'])} chat renders")
    syn = synthetic_fixture()
    write_json(os.path.join(OUT, "chat_synthetic.json"), syn)
    print(f"chat_synthetic: {len(syn)} renders")
    tiny = tiny_hf_fixture()
    write_json(os.path.join(OUT, "tiny_hf.json"), tiny)
    print(f"tiny_hf: {len(tiny['cases'])} strings, {len(tiny['chat'])} chat renders")


if __name__ == "__main__":
    main()
