#!/usr/bin/env python3
"""Regenerate responses with the target itself on one GPU: a batched decode loop over a static KV cache with
continuous refills (self-distillation data for DFlash, the same output format as regen.py).

llama-server was CPU-bound at about 2.6k tokens/s on the H200 (it samples every slot on its main thread);
this loop keeps S slots (default 768) decoding in lock-step, one target forward per step for all of them:

  state   per slot: the position `pos` of its next input token, the tokens generated so far, done
  step    x = embed(tok[S]); per layer: q, k, v of the S rows; RoPE at pos; k, v written into the cache at
          pos; attention of each row over its own cache rows 0..pos (grouped-query: the 6 query heads of a
          KV head are 6 query rows against it); MLP. Logits -> next token (greedy or sampled per slot)
  refill  every --refill steps the finished slots are harvested and new prompts prefilled into them (a
          causal forward over the right-padded prompts that writes their K/V at positions 0..len-1)

The forward is Qwen2's (transformers' Qwen2ForCausalLM: RMSNorm in float32, q/k/v biases, RoPE rotate-half,
SiLU MLP) on the same dequantized bf16 weights train.py uses; tools/dflash/check_train.py checks it against
transformers' own forward and greedy generate on a small random Qwen2.

Sampling mirrors regen.py's llama-server requests: greedy, or top-k 20 -> top-p 0.8 -> temperature 0.7.
Each output line: {"id", "src", "mode", "prompt_ids", "response_ids", "stop"}; a response that ended at
<|im_end|>/<|endoftext|> ends with 151645 and has stop "eos", else stop "limit".

usage: gen.py --gguf TARGET.gguf --prompts P.jsonl[,P2.jsonl] --out regen.jsonl [--skip-ids used.txt]
              [--seconds 240] [--slots 768] [--max-new 512]
"""

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

EOG = (151645, 151643)  # <|im_end|>, <|endoftext|>


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rot(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


class FastQwen2:
    """Qwen2 forward over a static per-slot KV cache [layers, S, kv_heads, max_len, head_dim] (bf16)."""

    def __init__(self, model, slots, max_len, device, dt=torch.bfloat16):
        c = model.config
        self.H, self.nh, self.nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or self.H // self.nh
        self.rep = self.nh // self.nkv
        self.eps = c.rms_norm_eps
        self.L = c.num_hidden_layers
        self.S, self.max_len = slots, max_len
        m = model.model
        self.layers = []
        for ly in m.layers:
            a, p = ly.self_attn, ly.mlp
            bias = [x.bias if x.bias is not None else torch.zeros(x.weight.shape[0], device=x.weight.device)
                    for x in (a.q_proj, a.k_proj, a.v_proj)]
            self.layers.append(dict(
                ln1=ly.input_layernorm.weight, ln2=ly.post_attention_layernorm.weight,
                wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).to(device, dt),
                bqkv=torch.cat(bias).to(device, dt),
                wo=a.o_proj.weight, wgu=torch.cat([p.gate_proj.weight, p.up_proj.weight]).to(device, dt),
                wd=p.down_proj.weight))
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.head = model.lm_head.weight
        rope = getattr(c, "rope_parameters", None) or {}
        theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or getattr(c, "rope_theta", 1e4)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32, device=device) / self.hd))
        f = torch.arange(max_len, dtype=torch.float32, device=device)[:, None] * inv[None]
        emb = torch.cat([f, f], dim=-1)
        self.cos, self.sin = emb.cos().to(dt), emb.sin().to(dt)
        shape = (self.L, slots, self.nkv, max_len, self.hd)
        self.ck = torch.zeros(shape, dtype=dt, device=device)
        self.cv = torch.zeros(shape, dtype=dt, device=device)
        self.device = device

    @torch.no_grad()
    def prefill(self, slots, prompts):
        """Write the K/V of `prompts` (lists of ids) into cache rows `slots` at positions 0..len-1; returns the
        logits [n, V] (float32) after each prompt's last token."""
        n, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((n, P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        sl = torch.tensor(slots, device=self.device)
        cos, sin = self.cos[:P][None, None], self.sin[:P][None, None]
        x = self.embed[ids]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        for li, w in enumerate(self.layers):
            h = rms(x, w["ln1"], self.eps)
            qkv = F.linear(h, w["wqkv"], w["bqkv"])
            q = qkv[..., : nh * hd].view(n, P, nh, hd).transpose(1, 2)
            k = qkv[..., nh * hd: (nh + nkv) * hd].view(n, P, nkv, hd).transpose(1, 2)
            v = qkv[..., (nh + nkv) * hd:].view(n, P, nkv, hd).transpose(1, 2)
            q, k = rot(q, cos, sin), rot(k, cos, sin)
            self.ck[li, sl, :, :P] = k
            self.cv[li, sl, :, :P] = v
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1),
                                               is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(n, P, nh * hd), w["wo"])
            g, u = F.linear(rms(x, w["ln2"], self.eps), w["wgu"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, w["wd"])
        x = x[torch.arange(n, device=self.device), last]
        return F.linear(rms(x, self.norm, self.eps), self.head).float()

    @torch.no_grad()
    def step(self, tok, pos, kv_len):
        """One decode step for all S slots: tok [S] at positions pos [S] (< kv_len, a host-side bound on
        max(pos) + 1). Returns logits [S, V] (float32)."""
        S, nh, nkv, hd, rep = self.S, self.nh, self.nkv, self.hd, self.rep
        ar = torch.arange(S, device=self.device)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        mask = (torch.arange(kv_len, device=self.device)[None] <= pos[:, None])[:, None, None, :]
        x = self.embed[tok]
        for li, w in enumerate(self.layers):
            h = rms(x, w["ln1"], self.eps)
            qkv = F.linear(h, w["wqkv"], w["bqkv"])
            q = rot(qkv[:, : nh * hd].view(S, nh, hd), cos, sin)
            k = rot(qkv[:, nh * hd: (nh + nkv) * hd].view(S, nkv, hd), cos, sin)
            v = qkv[:, (nh + nkv) * hd:].view(S, nkv, hd)
            self.ck[li, ar, :, pos] = k
            self.cv[li, ar, :, pos] = v
            a = F.scaled_dot_product_attention(q.view(S, nkv, rep, hd), self.ck[li, :, :, :kv_len],
                                               self.cv[li, :, :, :kv_len], attn_mask=mask)
            x = x + F.linear(a.reshape(S, nh * hd), w["wo"])
            g, u = F.linear(rms(x, w["ln2"], self.eps), w["wgu"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, w["wd"])
        return F.linear(rms(x, self.norm, self.eps), self.head).float()


def sample(logits, greedy, gen):
    """greedy [S] bool: argmax; else top-k 20, top-p 0.8 (on the untempered softmax), temperature 0.7."""
    am = logits.argmax(-1)
    tv, ti = logits.topk(20, dim=-1)
    p = torch.softmax(tv, -1)
    keep = (p.cumsum(-1) - p) < 0.8
    z = torch.where(keep, tv / 0.7, torch.full_like(tv, -float("inf")))
    pick = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)[:, 0]
    return torch.where(greedy, am, ti.gather(1, pick[:, None])[:, 0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf")
    ap.add_argument("--hf-dir")
    ap.add_argument("--prompts", required=True, help="comma-separated JSONL files of {id, src, ids}; taken in "
                    "order, then again (sampled only) while time remains")
    ap.add_argument("--prefer-src", default="", help="comma-separated prompt sources answered first in each "
                    "round of new samples (e.g. sharegpt)")
    ap.add_argument("--skip-ids", default="", help="file of prompt ids (one a line) to leave out of the first round")
    ap.add_argument("--out", required=True)
    ap.add_argument("--slots", type=int, default=768)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--refill", type=int, default=16, help="decode steps between harvest/refill rounds")
    ap.add_argument("--prefill-batch", type=int, default=96)
    ap.add_argument("--sampled-frac", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--max-prompts", type=int, default=0, help="stop after this many prompts (tests)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="float32: tests")
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    t_start = time.time()
    rng = random.Random(args.seed)
    gen = torch.Generator(device=args.device)
    gen.manual_seed(args.seed)

    from transformers import AutoModelForCausalLM
    if args.gguf:
        d, f = os.path.dirname(args.gguf), os.path.basename(args.gguf)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dt)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=dt)
    model = model.to(args.device).eval().requires_grad_(False)
    max_len = args.max_prompt + args.max_new
    fm = FastQwen2(model, args.slots, max_len, args.device, dt)
    log(f"target loaded in {time.time() - t_start:.0f} s; {args.slots} slots x {max_len} positions")

    skip = set(open(args.skip_ids).read().split()) if args.skip_ids else set()
    prefer = set(x for x in args.prefer_src.split(",") if x)
    prompts = []
    for path in args.prompts.split(","):
        for line in open(path):
            if line.strip():
                o = json.loads(line)
                if 2 <= len(o["ids"]) <= args.max_prompt:
                    prompts.append(o)

    def jobs():
        for o in prompts:  # first round: the prompts not answered before, greedy or sampled
            if o["id"] not in skip:
                yield o, ("sampled" if rng.random() < args.sampled_frac else "greedy")
        while True:  # then every prompt again, sampled (new samples of known prompts); --prefer-src first
            order = list(prompts)
            rng.shuffle(order)
            order.sort(key=lambda o: o["src"] not in prefer)  # stable: shuffled within each part
            for o in order:
                yield o, "sampled"

    feed = jobs()
    S = args.slots
    dev = args.device
    tok = torch.zeros(S, dtype=torch.long, device=dev)
    pos = torch.zeros(S, dtype=torch.long, device=dev)
    greedy = torch.zeros(S, dtype=torch.bool, device=dev)
    done = torch.ones(S, dtype=torch.bool, device=dev)
    out = torch.zeros((S, args.max_new), dtype=torch.long, device=dev)
    ngen = torch.zeros(S, dtype=torch.long, device=dev)
    eog = torch.tensor(EOG, device=dev)
    job = [None] * S  # (prompt obj, mode) per slot
    host_pos = [0] * S  # host copy of pos, for the attention length bound
    fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    n_done = n_tok = n_prompts = 0
    t0 = time.time()
    stopping = False
    last_log = t0

    def finished():
        return time.time() - t_start > args.seconds or (args.stop_file and os.path.exists(args.stop_file))

    while True:
        # harvest finished slots
        d = done.cpu().tolist()
        free = [i for i in range(S) if d[i]]
        live = [i for i in free if job[i] is not None]
        if live:
            rows = out[live].cpu().tolist()
            ng = ngen[live].cpu().tolist()
            lines = []
            for i, r, n in zip(live, rows, ng):
                o, mode = job[i]
                toks = r[:n]
                stop = "limit"
                if toks and toks[-1] in EOG:
                    while toks and toks[-1] in EOG:
                        toks.pop()
                    toks.append(151645)
                    stop = "eos"
                lines.append(json.dumps({"id": o["id"], "src": o.get("src", ""), "mode": mode,
                                         "prompt_ids": o["ids"], "response_ids": toks, "stop": stop},
                                        separators=(",", ":")) + "\n")
                n_done += 1
                n_tok += len(toks)
                job[i] = None
            os.write(fd, "".join(lines).encode())
        if time.time() - last_log > 20:
            dt = time.time() - t0
            log(f"gen: {n_done} responses, {n_tok} tokens, {n_tok / dt:.0f} tok/s, "
                f"{S - len(free)} busy slots")
            last_log = time.time()
        if not stopping and finished():
            stopping = True
        if args.max_prompts and n_prompts >= args.max_prompts:
            stopping = True
        # refill
        if not stopping:
            for s in range(0, len(free), args.prefill_batch):
                grp = free[s: s + args.prefill_batch]
                objs = []
                for _ in grp:
                    if args.max_prompts and n_prompts >= args.max_prompts:
                        break
                    objs.append(next(feed))
                    n_prompts += 1
                if not objs:
                    break
                grp = grp[: len(objs)]
                logits = fm.prefill(grp, [o["ids"] for o, _ in objs])
                gi = torch.tensor(grp, device=dev)
                g = torch.tensor([m == "greedy" for _, m in objs], device=dev)
                first = sample(logits, g, gen)
                greedy[gi] = g
                tok[gi] = first
                pos[gi] = torch.tensor([len(o["ids"]) for o, _ in objs], device=dev)
                out[gi] = 0
                out[gi, 0] = first
                ngen[gi] = 1
                done[gi] = torch.isin(first, eog) | (args.max_new <= 1)
                for i, (o, m) in zip(grp, objs):
                    job[i] = (o, m)
                    host_pos[i] = len(o["ids"])
        if all(j is None for j in job):
            break
        # decode: each slot's pos grows by one per step; finished slots keep stepping (ignored) until refilled
        busy = [i for i in range(S) if job[i] is not None]
        for _ in range(args.refill):
            kv_len = min(max_len, max(host_pos[i] for i in busy) + 1)
            kv_len = min(max_len, -(-kv_len // 64) * 64)
            logits = fm.step(tok, pos.clamp(max=max_len - 1), kv_len)
            nxt = sample(logits, greedy, gen)
            act = ~done
            out[torch.arange(S, device=dev), ngen.clamp(max=args.max_new - 1)] = torch.where(
                act, nxt, out[torch.arange(S, device=dev), ngen.clamp(max=args.max_new - 1)])
            ngen = ngen + act.long()
            tok = nxt
            pos = pos + 1
            done = done | (act & (torch.isin(nxt, eog) | (ngen >= args.max_new) | (pos >= max_len - 1)))
            for i in busy:
                host_pos[i] += 1
    os.close(fd)
    dt = time.time() - t0
    log(f"gen finished: {n_done} responses, {n_tok} tokens in {dt:.0f} s ({n_tok / max(dt, 1e-9):.0f} tok/s)")


if __name__ == "__main__":
    sys.exit(main())
