#!/usr/bin/env python3
"""Regenerate responses with the target itself through llama-server (self-distillation data for DFlash).

Reads prompts.py's JSONL (token ids already rendered with the chat template), sends each to llama-server's
/completion endpoint as token ids from many threads at once (the server batches its parallel slots), and
appends one JSONL line per finished response:

  {"id", "src", "mode": "greedy"|"sampled", "prompt_ids": [...], "response_ids": [...], "stop": "eos"|...}

Held-out prompts (--heldout) go first and always greedy into --heldout-out; training prompts then follow,
each greedy or sampled (temperature 0.7, top-p 0.8, top-k 20) with probability --sampled-frac. The response
ends with <|im_end|> (151645) when the model stopped there. Stops at --seconds or when --stop-file exists.

usage: regen.py --url http://127.0.0.1:8081 --prompts prompts_train.jsonl --out regen.jsonl
                [--heldout prompts_heldout.jsonl --heldout-out heldout.jsonl] [--threads 128]
"""

import argparse
import json
import os
import queue
import random
import threading
import time
import urllib.request
import zlib

EOG = (151645, 151643)  # <|im_end|>, <|endoftext|>


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="one or more llama-server URLs, comma-separated")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--heldout")
    ap.add_argument("--heldout-out")
    ap.add_argument("--threads", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--sampled-frac", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="skip the first N training prompts (another client "
                    "took them)")
    args = ap.parse_args()
    urls = args.url.split(",")
    rng = random.Random(args.seed)
    t_end = time.time() + args.seconds

    jobs = queue.Queue()
    if args.heldout:
        for line in open(args.heldout):
            o = json.loads(line)
            jobs.put((o, "greedy", args.heldout_out))
    for k, line in enumerate(open(args.prompts)):
        o = json.loads(line)
        mode = "sampled" if rng.random() < args.sampled_frac else "greedy"
        if k >= args.start:
            jobs.put((o, mode, args.out))

    lock = threading.Lock()
    files = {}
    stats = {"done": 0, "tokens": 0, "errors": 0}
    t0 = time.time()

    def stopped():
        return time.time() > t_end or (args.stop_file and os.path.exists(args.stop_file))

    def worker(k):
        while not stopped():
            try:
                o, mode, out = jobs.get_nowait()
            except queue.Empty:
                return
            body = {"prompt": o["ids"], "n_predict": args.max_tokens, "return_tokens": True,
                    "cache_prompt": False, "seed": zlib.crc32(o["id"].encode())}
            if mode == "greedy":
                body.update(temperature=0.0, top_k=1)
            else:
                body.update(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0)
            try:
                r = post(urls[k % len(urls)] + "/completion", body)
            except Exception as e:  # a failed request is retried once, then loses one prompt, not the run
                with lock:
                    stats["errors"] += 1
                    if stats["errors"] <= 5:
                        print(f"request failed: {e}", flush=True)
                if not o.get("retried"):
                    jobs.put(({**o, "retried": True}, mode, out))
                continue
            toks = list(r.get("tokens") or [])
            if not toks and r.get("content"):
                toks = post(urls[k % len(urls)] + "/tokenize", {"content": r["content"]}).get("tokens", [])
            while toks and toks[-1] in EOG:
                toks.pop()
            stop = r.get("stop_type") or ("eos" if r.get("stopped_eos") else "limit")
            if stop == "eos":
                toks.append(151645)
            line = json.dumps({"id": o["id"], "src": o.get("src", ""), "mode": mode, "prompt_ids": o["ids"],
                               "response_ids": toks, "stop": stop}, separators=(",", ":")) + "\n"
            with lock:
                # one O_APPEND write per line: several clients may append to the same file
                if out not in files:
                    files[out] = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(files[out], line.encode())
                stats["done"] += 1
                stats["tokens"] += len(toks)
                if stats["done"] % 500 == 0:
                    dt = time.time() - t0
                    print(f"regen: {stats['done']} responses, {stats['tokens']} tokens, "
                          f"{stats['tokens'] / dt:.0f} tok/s, {stats['errors']} errors", flush=True)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in files.values():
        os.close(fd)
    dt = time.time() - t0
    print(f"regen finished: {stats['done']} responses, {stats['tokens']} tokens in {dt:.0f} s "
          f"({stats['tokens'] / max(dt, 1e-9):.0f} tok/s), {stats['errors']} errors", flush=True)


if __name__ == "__main__":
    main()
