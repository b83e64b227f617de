"""The official `openai` Python SDK's Responses API against eddy serve: a reply whole and streamed, a forced
function call with its output sent back, a structured output, and an error the SDK maps to its exception type.

usage: responses_client.py BASE_URL TOOLS_BASE_URL  -> prints one JSON object on stdout:
  {"whole": {...}, "stream": {...}, "call": {...}, "answer": {...}, "structured": {...}, "error": {...}}
The Rust test compares them with the chat API's answers. Exits non-zero if the SDK raises (it parses every
event and the final response as it reads them).
"""
import json
import sys

import openai

base, tools_base = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="not-needed", max_retries=0, timeout=300)
ask = dict(model="m", instructions="You are terse.", input="Name three colors of the rainbow.", max_output_tokens=24,
           temperature=0)
out = {}

r = client.responses.create(**ask)
assert r.object == "response", r
out["whole"] = {"text": r.output_text, "status": r.status, "usage": r.usage.model_dump(exclude_none=True),
                "items": [o.type for o in r.output]}

types = []
with client.responses.stream(**ask) as s:
    for ev in s:
        types.append(ev.type)
    final = s.get_final_response()
out["stream"] = {"text": final.output_text, "status": final.status, "first": types[0], "last": types[-1],
                 "deltas": types.count("response.output_text.delta")}

tc = openai.OpenAI(base_url=tools_base, api_key="not-needed", max_retries=0, timeout=300)
tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
question = [{"role": "user", "content": "What is the weather in Paris?"}]
r = tc.responses.create(model="q", input=question, tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                        max_output_tokens=64, temperature=0)
call = next(o for o in r.output if o.type == "function_call")
out["call"] = {"name": call.name, "arguments": json.loads(call.arguments), "call_id": call.call_id}
r = tc.responses.create(model="q", tools=tools, max_output_tokens=32, temperature=0, input=question + [
    {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
])
out["answer"] = {"text": r.output_text, "calls": [o.name for o in r.output if o.type == "function_call"],
                 "arguments": call.arguments}

schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
r = tc.responses.create(model="q", input=question, max_output_tokens=48, temperature=0,
                        text={"format": {"type": "json_schema", "name": "w", "schema": schema}})
out["structured"] = json.loads(r.output_text)

try:
    client.responses.create(model="m", input="hi", previous_response_id="resp_1")
    raise SystemExit("previous_response_id was accepted")
except openai.BadRequestError as e:
    out["error"] = {"status": e.status_code, "param": e.param}

json.dump(out, sys.stdout)
