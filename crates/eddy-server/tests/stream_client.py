"""Minimal OpenAI streaming client, Python standard library only.

usage: stream_client.py HOST:PORT  -> prints the streamed reply (greedy, 24 tokens) to stdout.
Exits non-zero if the stream is malformed (bad SSE line, missing role, missing [DONE], usage mismatch).
"""
import json
import sys
import urllib.request

addr = sys.argv[1]
body = {
    "messages": [{"role": "user", "content": "Name three colors of the rainbow."}],
    "temperature": 0,
    "max_tokens": 24,
    "stream": True,
    "stream_options": {"include_usage": True},
}
req = urllib.request.Request(
    f"http://{addr}/v1/chat/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json"},
)
text, chunks, done, usage = [], [], False, None
with urllib.request.urlopen(req) as resp:
    assert resp.headers["Content-Type"].startswith("text/event-stream"), resp.headers["Content-Type"]
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\n")
        if not line or line.startswith(":"):
            continue  # event separator, or an SSE comment (": keep-alive")
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        chunks.append(chunk)
        if chunk["choices"]:
            text.append(chunk["choices"][0]["delta"].get("content", ""))
        else:
            usage = chunk["usage"]
assert done, "no [DONE]"
assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
assert usage is not None and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
sys.stdout.write("".join(text))
