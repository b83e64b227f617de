"""The official `anthropic` Python SDK against eddy serve's Messages API: a reply whole and streamed, a token
count, an error the SDK maps to its exception type, a forced tool call with its result sent back, a
structured output, and the Models API (list, retrieve, an unknown id).

usage: anthropic_client.py BASE_URL TOOLS_BASE_URL  -> prints one JSON object on stdout:
  {"whole": {...}, "stream": {...}, "count": N, "error": {...}, "tool": {...}, "tool_stream": {...}, "answer": {...},
   "structured": {...}, "models": {...}}
Each entry holds what the SDK parsed; the Rust test compares them with the chat API's answers. Exits non-zero
if the SDK raises (it validates the response shapes and the event stream as it parses them).
"""
import json
import sys

import anthropic

base, tools_base = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key="not-needed", max_retries=0, timeout=300)
system = "You are terse."
messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
out = {}
# This SDK has no sampling parameters; the server reads them from the body (greedy: the test compares replies).
greedy = {"temperature": 0}

m = client.messages.create(model="claude-test", max_tokens=24, extra_body=greedy, system=system, messages=messages)
assert m.type == "message" and m.role == "assistant", m
out["whole"] = {"text": "".join(b.text for b in m.content if b.type == "text"), "stop_reason": m.stop_reason,
                "model": m.model, "usage": m.usage.model_dump(exclude_none=True)}

with client.messages.stream(model="claude-test", max_tokens=24, extra_body=greedy, system=system, messages=messages) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
out["stream"] = {"text": text, "final": "".join(b.text for b in final.content if b.type == "text"),
                 "stop_reason": final.stop_reason, "output_tokens": final.usage.output_tokens}

out["count"] = client.messages.count_tokens(model="claude-test", system=system, messages=messages).input_tokens

try:
    client.messages.create(model="claude-test", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    raise SystemExit("an image was accepted")
except anthropic.BadRequestError as e:
    out["error"] = {"status": e.status_code, "type": e.body["error"]["type"]}

# A forced call on a tool model, whole and streamed, then its result sent back.
tc = anthropic.Anthropic(base_url=tools_base, api_key="not-needed", max_retries=0, timeout=300)
tools = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
forced = {"type": "tool", "name": "get_weather"}
m = tc.messages.create(model="q", max_tokens=64, extra_body=greedy, tools=tools, tool_choice=forced, messages=ask)
call = next(b for b in m.content if b.type == "tool_use")
out["tool"] = {"name": call.name, "input": call.input, "stop_reason": m.stop_reason}
with tc.messages.stream(model="q", max_tokens=64, extra_body=greedy, tools=tools, tool_choice=forced, messages=ask) as s:
    final = s.get_final_message()
scall = next(b for b in final.content if b.type == "tool_use")
out["tool_stream"] = {"name": scall.name, "input": scall.input, "stop_reason": final.stop_reason}
m = tc.messages.create(model="q", max_tokens=32, extra_body=greedy, tools=tools, messages=ask + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}]},
])
out["answer"] = {"id": call.id, "text": "".join(b.text for b in m.content if b.type == "text"),
                 "calls": [b.name for b in m.content if b.type == "tool_use"], "stop_reason": m.stop_reason}

# Structured output (output_config.format): the reply is JSON of the schema.
schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
m = tc.messages.create(model="q", max_tokens=48, extra_body=greedy, messages=ask,
                       output_config={"format": {"type": "json_schema", "schema": schema}})
out["structured"] = json.loads("".join(b.text for b in m.content if b.type == "text"))

# The Models API as this SDK reads it (a page of ModelInfo; retrieve one; an unknown id is NotFoundError).
page = client.models.list()
info = client.models.retrieve(page.data[0].id)
assert info.type == "model" and info.lifecycle == "active", info
try:
    client.models.retrieve("claude-nonexistent")
    raise SystemExit("an unknown model was found")
except anthropic.NotFoundError as e:
    missing = e.body["error"]["type"]
out["models"] = {"ids": [m.id for m in page.data], "has_more": page.has_more, "retrieved": info.id,
                 "display_name": info.display_name, "created_year": info.created_at.year,
                 "max_input_tokens": info.max_input_tokens, "missing": missing}

json.dump(out, sys.stdout)
