"""The official `openai` Python SDK against eddy serve: chat and text completions, streaming and not.

usage: openai_client.py BASE_URL MODEL  -> prints one JSON object on stdout:
  {"chat": {...}, "chat_stream": {...}, "completion": {...}, "completion_stream": {...}, "chat_n": {...},
   "chat_n_stream": {...}, "models": [...], "error": {...}}
Each entry holds the text, finish_reason and usage the SDK parsed; the Rust test compares them with the raw
HTTP answers. Exits non-zero if the SDK raises (it validates the response shapes as it parses them).
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="not-needed", max_retries=0, timeout=300)
messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
out = {"models": [m.id for m in client.models.list().data]}

r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
assert r.object == "chat.completion", r.object
c = r.choices[0]
out["chat"] = {
    "text": c.message.content,
    "role": c.message.role,
    "finish_reason": c.finish_reason,
    "usage": r.usage.model_dump(exclude_none=True),
}

text, finish, usage, roles = [], None, None, []
stream = client.chat.completions.create(
    model=model, messages=messages, temperature=0, max_tokens=24, stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    assert chunk.object == "chat.completion.chunk", chunk.object
    if chunk.usage is not None:
        usage = chunk.usage.model_dump(exclude_none=True)
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    if d.role:
        roles.append(d.role)
    if d.content:
        text.append(d.content)
    if chunk.choices[0].finish_reason is not None:
        assert finish is None, "two finish reasons"
        finish = chunk.choices[0].finish_reason
out["chat_stream"] = {"text": "".join(text), "role": roles[0] if roles else None, "finish_reason": finish,
                      "usage": usage}

prompt = "The capital of France is"
r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12)
assert r.object == "text_completion", r.object
out["completion"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                     "usage": r.usage.model_dump(exclude_none=True)}

text, finish = [], None
for chunk in client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12, stream=True):
    if chunk.choices:
        text.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish = chunk.choices[0].finish_reason
out["completion_stream"] = {"text": "".join(text), "finish_reason": finish}

# n=2: the choices whole, and streamed (chunks of both indexes, gathered by index).
r = client.chat.completions.create(model=model, messages=messages, temperature=1.0, seed=5, max_tokens=16, n=2)
out["chat_n"] = {"texts": [c.message.content for c in sorted(r.choices, key=lambda c: c.index)],
                 "usage": r.usage.model_dump(exclude_none=True)}
texts, finishes = {}, {}
for chunk in client.chat.completions.create(model=model, messages=messages, temperature=1.0, seed=5, max_tokens=16,
                                            n=2, stream=True):
    for c in chunk.choices:
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        if c.finish_reason is not None:
            finishes[c.index] = c.finish_reason
out["chat_n_stream"] = {"texts": [texts[i] for i in sorted(texts)], "finishes": len(finishes)}

# An error the SDK maps to its exception type, with the OpenAI error object parsed.
try:
    client.chat.completions.create(model=model, messages=messages, n=17)
    raise SystemExit("n=17 was accepted")
except openai.BadRequestError as e:
    out["error"] = {"status": e.status_code, "param": e.param, "code": e.code}

json.dump(out, sys.stdout)
