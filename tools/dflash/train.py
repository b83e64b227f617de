#!/usr/bin/env python3
"""Train a DFlash block drafter (arXiv 2602.06036) against a frozen target, export it in the z-lab/SpecForge
Hugging Face format, and measure its offline acceptance.

The drafter (one or more Qwen3-style decoder layers) reads the target's residual stream after the decoder
layers `target_layer_ids` (hidden_states[id + 1] in transformers' numbering), concatenated over those layers:

    ctx   = hidden_norm(fc(features))                       [T, H]      one row per context token
    h     = embed([anchor, MASK x 15])                      [16, H]     the target's embedding table
    layer:  x = input_layernorm(h)
            q = q_norm(q_proj(x))                           block rows only
            k = k_norm(k_proj([ctx ; x]))   v = v_proj([ctx ; x])       ctx is NOT layer-normed
            RoPE at absolute positions: context token j at j, block slot i at anchor_pos + i
            a = softmax(q k^T / sqrt(hd)) v   over context tokens strictly before the anchor + the whole
                                              block (non-causal inside the block)
            h = h + o_proj(a);  h = h + down(silu(gate(y)) * up(y)),  y = post_attention_layernorm(h)
    logits = lm_head(norm(h))[1:]       slot k (1..15) predicts the token at anchor_pos + k

Training (SpecForge's DFlash recipe): random anchors in the response part of each self-distilled sequence,
cross-entropy on slots 1..15 weighted by exp(-(k-1)/gamma), AdamW with warm-up and a cosine decay over a
wall-clock budget, gradient clipping 1.0. The target (embedding, LM head, layers) stays frozen.

Offline acceptance: on held-out sequences the target generated greedily, every response position with 15
tokens after it is an anchor; the accepted length there is the number of leading slots whose argmax equals
the sequence's next tokens, and tau = 1 + its mean (the target's bonus token included), as a greedy
speculative step with this drafter would accept.

Inputs: --data, a JSONL file that may still be growing (regen.py's output: prompt_ids, response_ids);
--heldout, the same format. The target comes from a GGUF file (--gguf, dequantized by transformers) or a
transformers folder (--hf-dir, for tests with a tiny random model).
"""

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK = 16


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (Qwen3RMSNorm's arithmetic)."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_cos_sin(pos, head_dim, theta):
    """cos, sin [..., head_dim] (float32) for integer positions `pos` (NeoX half-split layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    f = pos.float()[..., None] * inv
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [B, heads, N, hd]; cos/sin [B, N, hd]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, x, ctx, rope_q, rope_k, ctx_mask):
        """x [B, Q, H] block rows (Q = A blocks x 16), ctx [B, T, H]; ctx_mask [B, Q, T] bool, True where a
        block row may see a context key. Every row also sees the 16 rows of its own block (non-causal).

        The softmax runs over [context keys ; own block's keys] only (never the other blocks' rows), in
        float32: scores of the two parts are concatenated before the softmax, so this equals attention over
        [ctx ; all block rows] with the block-diagonal mask, at a fraction of the cost."""
        B, Q, _ = x.shape
        T = ctx.shape[1]
        A = Q // BLOCK
        nkv, rep, hd = self.nkv, self.nh // self.nkv, self.hd
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1).view(B, T + Q, nkv, hd)
        k = self.k_norm(k).transpose(1, 2)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1).view(B, T + Q, nkv, hd)
        v = v.transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        dt = v.dtype
        q, k = q.to(dt), k.to(dt)
        qg = q.reshape(B, nkv, rep * Q, hd) * (1.0 / math.sqrt(hd))  # head h uses KV head h // rep
        kc, kb = k[:, :, :T], k[:, :, T:]
        vc, vb = v[:, :, :T], v[:, :, T:]
        sdt = torch.promote_types(dt, torch.float32)  # softmax precision: float32 (float64 in the checks)
        s_c = (qg @ kc.transpose(-1, -2)).to(sdt).view(B, nkv, rep, Q, T)
        s_c.masked_fill_(~ctx_mask[:, None, None], -float("inf"))  # s_c is saved by nothing: in place
        qb = qg.view(B, nkv, rep, A, BLOCK, hd)
        s_b = torch.einsum("bgrasd,bgatd->bgrast", qb, kb.reshape(B, nkv, A, BLOCK, hd)).to(sdt)
        s = torch.cat([s_c, s_b.reshape(B, nkv, rep, Q, BLOCK)], dim=-1)
        del s_c
        p = torch.softmax(s, dim=-1).to(dt)
        o = (p[..., :T].reshape(B, nkv, rep * Q, T) @ vc).view(B, nkv, rep, Q, hd)
        o = o + torch.einsum("bgrast,bgatd->bgrasd", p[..., T:].reshape(B, nkv, rep, A, BLOCK, BLOCK),
                             vb.reshape(B, nkv, A, BLOCK, hd)).reshape(B, nkv, rep, Q, hd)
        o = o.reshape(B, self.nh, Q, hd).transpose(1, 2).reshape(B, Q, self.nh * hd)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, h, ctx, rope_q, rope_k, ctx_mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_k, ctx_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """Parameter names are the exported tensor names (fc.weight, layers.0.self_attn.q_proj.weight, ...)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        n_sel = len(c["dflash_config"]["target_layer_ids"])
        self.fc = nn.Linear(n_sel * c["hidden_size"], c["hidden_size"], bias=False)
        self.hidden_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, feats, block_emb, block_pos, ctx_mask, row_seq=None):
        """feats [B, T, n_sel*H] target features of the context tokens (positions 0..T-1);
        block_emb [R, Q, H] embeddings of the blocks' tokens (Q = A x 16); block_pos [R, Q] their absolute
        positions; ctx_mask [R, Q, T] bool, True where a block row may see a context token (those strictly
        before its anchor); row_seq [R]: the sequence whose context each row reads (None: row r reads
        sequence r, R = B). Returns norm(h) [R, Q, H]."""
        T = feats.shape[1]
        ctx = self.hidden_norm(self.fc(feats))
        if row_seq is not None:
            ctx = ctx[row_seq]
        R = ctx.shape[0]
        hd, theta = self.c["head_dim"], self.c["rope_theta"]
        ctx_pos = torch.arange(T, device=feats.device)[None].expand(R, T)
        rope_q = rope_cos_sin(block_pos, hd, theta)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, block_pos], dim=1), hd, theta)
        h = block_emb
        for layer in self.layers:
            h = layer(h, ctx, rope_q, rope_k, ctx_mask)
        return self.norm(h)


# ----------------------------------------------------------------------------------------------------------
# target


class Target:
    """Frozen target: embedding table, LM head, and the residual stream after chosen decoder layers."""

    def __init__(self, args, layer_ids, device):
        from transformers import AutoModelForCausalLM
        t0 = time.time()
        if args.gguf:
            d, f = os.path.dirname(args.gguf), os.path.basename(args.gguf)
            m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
        else:
            m = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.bfloat16)
        self.model = m.to(device).eval().requires_grad_(False)
        self.config = m.config
        L = m.config.num_hidden_layers
        # default: 5 layers spread from 1 to L-3 (z-lab's build_target_layer_ids for 5 draft layers)
        self.layer_ids = layer_ids or [int(round(1 + i * (L - 4) / 4)) for i in range(5)]
        if not all(0 <= i < L for i in self.layer_ids):
            raise SystemExit(f"target layer ids {self.layer_ids} out of range for {L} layers")
        self.embed = m.model.embed_tokens
        self.lm_head_w = m.lm_head.weight  # [V, H]
        self.captured = {}
        self.last = max(self.layer_ids)
        for i in self.layer_ids:
            m.model.layers[i].register_forward_hook(self._hook(i))
        log(f"target loaded in {time.time() - t0:.0f} s: {m.config.num_hidden_layers} layers, "
            f"hidden {m.config.hidden_size}, vocab {m.config.vocab_size}")

    class _Stop(Exception):
        pass

    def _hook(self, i):
        def hook(_mod, _inp, out):
            self.captured[i] = out[0] if isinstance(out, tuple) else out
            if i == self.last:
                raise Target._Stop()  # later layers are not needed
        return hook

    @torch.no_grad()
    def features(self, ids):
        """ids [B, T] right-padded (causal attention: padding never reaches real tokens) ->
        [B, T, len(layer_ids) * H] bf16."""
        self.captured = {}
        try:
            self.model.model(input_ids=ids, use_cache=False)
        except Target._Stop:
            pass
        return torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)


# ----------------------------------------------------------------------------------------------------------
# data


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class GrowingData:
    """Sequences from JSONL files (gzip when the name ends in .gz) that other processes may still append to
    (complete lines only)."""

    def __init__(self, paths, max_len):
        self.paths, self.max_len = paths, max_len
        self.offsets = {p: 0 for p in paths}
        self.seqs = []  # (ids list, prompt_len)
        self.token_counts = {}
        self.order = []

    def refresh(self, rng=None):
        n = 0
        for path in self.paths:
            if not os.path.exists(path):
                continue
            if path.endswith(".gz"):
                if self.offsets[path]:
                    continue
                import gzip
                with gzip.open(path, "rb") as f:
                    chunk = f.read()
                self.offsets[path] = 1
            else:
                with open(path, "rb") as f:
                    f.seek(self.offsets[path])
                    chunk = f.read()
                end = chunk.rfind(b"\n")
                if end < 0:
                    continue
                chunk = chunk[: end + 1]
                self.offsets[path] += end + 1
            for line in chunk.splitlines():
                try:
                    o = json.loads(line)
                except json.JSONDecodeError:
                    continue
                p, r = o["prompt_ids"], o["response_ids"]
                for t in r:
                    self.token_counts[t] = self.token_counts.get(t, 0) + 1
                if len(r) < 4:
                    continue
                ids = (p + r)[: self.max_len]
                if len(ids) - len(p) < 4:
                    continue
                self.seqs.append((ids, len(p)))
                n += 1
        if n or not self.order:
            r = rng or random.Random(0)
            # similar lengths side by side (jittered, so that batches differ between refreshes)
            self.order = sorted(range(len(self.seqs)), key=lambda i: len(self.seqs[i][0]) + r.random() * 96)
        return n

    def batch(self, rng, token_budget, max_batch, block_budget, anchors):
        """Consecutive sequences of similar length from a random start, while the padded size fits the
        token budget and their anchors (min(response - 1, anchors) each) the block budget."""
        order = self.order
        start = rng.randrange(len(order))
        picked, longest, blocks = [], 0, 0
        for j in range(start, start + len(order)):
            i = order[j % len(order)]
            ids, pl = self.seqs[i]
            L, nb = len(ids), min(len(ids) - pl - 1, anchors)
            if picked and (max(longest, L) * (len(picked) + 1) > token_budget or len(picked) >= max_batch
                           or blocks + nb > block_budget):
                break
            picked.append(i)
            longest, blocks = max(longest, L), blocks + nb
        return [self.seqs[i] for i in picked]


class Prefetch:
    """Builds the host part of the next training batches in a background thread (data refresh every 20 s,
    batch choice, anchors, `pack_host` into pinned memory), so that the GPU never waits for Python batch
    assembly. Owns `data` and `rng` while it runs."""

    def __init__(self, data, args, rng, pin, depth=4):
        import queue
        import threading
        self.data, self.args, self.rng, self.pin = data, args, rng, pin
        self.q = queue.Queue(depth)
        self.Empty, self.Full = queue.Empty, queue.Full
        self.halt = threading.Event()
        self.err = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        a = self.args
        try:
            last = time.time()
            while not self.halt.is_set():
                if time.time() - last > 20:
                    self.data.refresh(self.rng)
                    last = time.time()
                seqs = self.data.batch(self.rng, a.token_budget, a.max_batch, a.block_budget, a.anchors)
                anchors = pick_anchors(seqs, a.anchors, self.rng)
                item = (pack_host(seqs, anchors, a.chunk_anchors, self.pin), len(seqs),
                        max(len(s[0]) for s in seqs))
                while not self.halt.is_set():
                    try:
                        self.q.put(item, timeout=0.5)
                        break
                    except self.Full:
                        pass
        except BaseException as e:  # handed to the training loop by get()
            self.err = e

    def get(self):
        while True:
            try:
                return self.q.get(timeout=1.0)
            except self.Empty:
                if self.err is not None:
                    raise RuntimeError("batch assembly failed") from self.err
                if not self.thread.is_alive():
                    raise RuntimeError("batch assembly thread ended")

    def close(self):
        self.halt.set()
        self.thread.join()


def load_jsonl(path):
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
    return out


def pick_anchors(seqs, anchors_per_seq, rng, all_anchors=False):
    """Anchor positions per sequence, ascending: response positions with at least one label after them (or,
    `all_anchors`, a full 15-token label window), at most `anchors_per_seq` of them drawn with `rng`."""
    out = []
    for ids, pl in seqs:
        last = len(ids) - 2  # an anchor needs at least one label after it
        cand = list(range(pl, len(ids) - BLOCK)) if all_anchors else list(range(pl, last + 1))
        if len(cand) > anchors_per_seq:
            cand = sorted(rng.sample(cand, anchors_per_seq))
        out.append(cand)
    return out


def pack_host(seqs, anchors, chunk, pin=False, pad_id=0):
    """The host part of a batch: small integer tensors only (the blocks, labels and masks are built on the
    device by `blocks_on_device`). Each sequence's anchors are cut into drafter rows of at most `chunk`
    anchors (a row attends to its own sequence's context), so that a sequence with few anchors does not pad
    every other sequence to the longest anchor list.

    Returns ids [B, T] (right-padded, T a multiple of 16), lens [B], row_seq [R] (the sequence of each row),
    row_anchor [R, C] (anchor positions, -1 = none), valid_idx [N] (flat indices into R x C of the real
    anchors, in sequence order), counts (anchors per sequence, a list)."""
    B = len(seqs)
    T = -(-max(len(s[0]) for s in seqs) // 16) * 16  # a multiple of 16 keeps the fused attention kernels
    C = max(1, min(chunk, max(len(a) for a in anchors)))
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    for b, (s, _pl) in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
    lens = torch.tensor([len(s[0]) for s in seqs], dtype=torch.long)
    row_seq, rows = [], []
    for b, an in enumerate(anchors):
        for i in range(0, len(an), C):
            part = an[i: i + C]
            row_seq.append(b)
            rows.append(part + [-1] * (C - len(part)))
    if not rows:  # no anchor at all: one empty row keeps the shapes valid
        row_seq, rows = [0], [[-1] * C]
    row_anchor = torch.tensor(rows, dtype=torch.long)
    valid_idx = (row_anchor.view(-1) >= 0).nonzero().view(-1)
    out = [ids, lens, torch.tensor(row_seq, dtype=torch.long), row_anchor, valid_idx]
    if pin:
        out = [t.pin_memory() for t in out]
    return out + [[len(a) for a in anchors]]


def blocks_on_device(host, mask_id, device):
    """Blocks, positions, labels and context masks from `pack_host`'s tensors, built on `device` (no host
    work per anchor). Returns ids [B, T], row_seq [R], block_ids [R, C*16] ([anchor token, MASK x 15] per
    anchor), block_pos [R, C*16] (absolute positions anchor + 0..15), labels [R, C, 15] (the tokens at
    anchor + 1..15; -100 past the sequence end or for an empty slot), ctx_mask [R, C*16, T] bool (context
    tokens strictly before the anchor; an empty slot sees none, only its own block), valid_idx [N]."""
    ids, lens, row_seq, row_anchor, valid_idx = (t.to(device, non_blocking=True) for t in host[:5])
    R, C = row_anchor.shape
    T = ids.shape[1]
    valid = row_anchor >= 0
    apos = row_anchor.clamp(min=0)
    pos = apos[:, :, None] + torch.arange(BLOCK, device=device)  # [R, C, 16]
    tok = torch.gather(ids[row_seq], 1, pos.clamp(max=T - 1).view(R, C * BLOCK)).view(R, C, BLOCK)
    inside = (pos < lens[row_seq][:, None, None]) & valid[:, :, None]
    labels = torch.where(inside[:, :, 1:], tok[:, :, 1:], torch.full_like(tok[:, :, 1:], -100))
    block_ids = torch.full_like(tok, mask_id)
    block_ids[:, :, 0] = tok[:, :, 0]
    q_anchor = (apos * valid).repeat_interleave(BLOCK, dim=1)  # [R, C*16]
    ctx_mask = torch.arange(T, device=device)[None, None, :] < q_anchor[:, :, None]
    return ids, row_seq, block_ids.view(R, C * BLOCK), pos.view(R, C * BLOCK), labels, ctx_mask, valid_idx


def make_blocks(seqs, anchors, mask_id, device, chunk=32):
    """`pack_host` then `blocks_on_device` (the training loop does the first in a background thread)."""
    return blocks_on_device(pack_host(seqs, anchors, chunk), mask_id, device)


def chunked_ce(h, w_head, labels, weights, chunk_rows):
    """h [N, H], labels [N] -> (weighted loss sum, weight sum, argmax [N]); logits are recomputed in the
    backward pass chunk by chunk (never all [N, V] at once)."""
    from torch.utils.checkpoint import checkpoint

    def part(hc, lc):
        logits = (hc @ w_head.t()).float()
        ce = F.cross_entropy(logits, lc, ignore_index=-100, reduction="none")
        return ce, logits.argmax(-1)

    tot, preds = h.new_zeros((), dtype=torch.float32), []
    for s in range(0, h.shape[0], chunk_rows):
        hc, lc, wc = h[s: s + chunk_rows], labels[s: s + chunk_rows], weights[s: s + chunk_rows]
        if torch.is_grad_enabled():
            ce, pr = checkpoint(part, hc, lc, use_reentrant=False)
        else:
            ce, pr = part(hc, lc)
        tot = tot + (ce * wc).sum()
        preds.append(pr)
    return tot, torch.cat(preds)


class Readout:
    """The LM-head rows the drafter is trained and measured with: the target's whole head, or only the rows
    of a reduced draft vocabulary (`draft_vocab.json`, as eddy reads it at inference). `to_rows` maps a
    token id to its row (-100 outside: such labels carry no loss and always count as a miss), `ids` maps a
    row back to its token id."""

    def __init__(self, w_full, vocab_ids=None):
        V = w_full.shape[0]
        if vocab_ids is None:
            self.w, self.ids, self.to_rows = w_full, None, None
            return
        ids = torch.tensor(vocab_ids, dtype=torch.long, device=w_full.device)
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= V or ids.unique().numel() != ids.numel():
            raise SystemExit(f"draft vocabulary: {ids.numel()} ids, must be distinct and in [0, {V})")
        self.w, self.ids = w_full[ids].contiguous(), ids
        self.to_rows = torch.full((V,), -100, dtype=torch.long, device=w_full.device)
        self.to_rows[ids] = torch.arange(ids.numel(), device=w_full.device)

    def rows(self, labels):
        if self.to_rows is None:
            return labels
        return torch.where(labels >= 0, self.to_rows[labels.clamp(min=0)], labels)

    def tokens(self, rows):
        return rows if self.ids is None else self.ids[rows]


def run_blocks(drafter, target, blocks, args):
    """Target features, drafter forward and the slot-1..15 hidden states of the real anchors:
    (h [N*15, H] bf16, labels [N*15]); `blocks` is `blocks_on_device`'s tuple."""
    ids, row_seq, block_ids, block_pos, labels, ctx_mask, valid_idx = blocks
    feats = target.features(ids)
    with torch.no_grad():
        emb = target.embed(block_ids)
    with torch.autocast("cuda" if args.device.startswith("cuda") else "cpu", dtype=torch.bfloat16):
        out = drafter(feats, emb, block_pos, ctx_mask, row_seq)
    R, Q, H = out.shape
    h = out.view(R * (Q // BLOCK), BLOCK, H).index_select(0, valid_idx)[:, 1:].reshape(-1, H)
    return h.to(torch.bfloat16), labels.view(-1, BLOCK - 1).index_select(0, valid_idx).reshape(-1)


def accept_stats(pred, labels):
    """pred/labels [M, 15] -> accepted length per anchor (leading matches), for anchors with all labels."""
    full = (labels != -100).all(-1)
    match = (pred == labels) & (labels != -100)
    acc = match.long().cumprod(-1).sum(-1)
    return acc[full]


@torch.no_grad()
def evaluate(drafter, target, heldout, args, readouts):
    """Offline acceptance on held-out sequences, for each readout in `readouts` ({name: Readout}): tau and
    per-depth acceptance, overall and per source."""
    drafter.eval()
    rng = random.Random(0)
    by = {name: {} for name in readouts}
    for i in range(0, len(heldout), args.eval_batch):
        grp = heldout[i: i + args.eval_batch]
        seqs = [(s["prompt_ids"] + s["response_ids"], len(s["prompt_ids"])) for s in grp]
        # one forward per sequence group; anchors limited to keep the block rows bounded
        anchors = pick_anchors(seqs, args.eval_anchors, rng, all_anchors=True)
        blocks = make_blocks(seqs, anchors, args.mask_id, args.device, args.chunk_anchors)
        h, labels = run_blocks(drafter, target, blocks, args)
        counts = [len(a) for a in anchors]
        for name, ro in readouts.items():
            rl = ro.rows(labels)
            _, pred = chunked_ce(h, ro.w, rl, torch.ones_like(rl, dtype=torch.float32), args.chunk_rows)
            pred, lab = ro.tokens(pred).view(-1, BLOCK - 1), labels.view(-1, BLOCK - 1)
            for s, p, l in zip(grp, pred.split(counts), lab.split(counts)):
                by[name].setdefault(s.get("src", "all"), []).append(accept_stats(p, l).cpu())
    drafter.train()
    out = {}
    for name, by_src in by.items():
        res, allacc = {}, []
        for src, accs in sorted(by_src.items()):
            a = torch.cat(accs)
            allacc.append(a)
            res[src] = summarize(a)
        res["all"] = summarize(torch.cat(allacc)) if allacc else {}
        out[name] = res
    return out


def summarize(a):
    if a.numel() == 0:
        return {"anchors": 0}
    a = a.float()
    reach = [(a >= k).float().mean().item() for k in range(0, BLOCK)]  # reach[k] = P(accepted >= k)
    cond = [reach[k] / reach[k - 1] if reach[k - 1] > 0 else 0.0 for k in range(1, BLOCK)]
    return {"anchors": int(a.numel()), "tau": 1.0 + a.mean().item(),
            "p_accept_ge_k": [round(x, 4) for x in reach[1:]],
            "p_accept_k_given_k_minus_1": [round(x, 4) for x in cond]}


# ----------------------------------------------------------------------------------------------------------
# export


def drafter_config(tcfg, args):
    H = tcfg.hidden_size
    nh = tcfg.num_attention_heads
    hd = getattr(tcfg, "head_dim", None) or H // nh
    rope = getattr(tcfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(tcfg, "rope_theta", 10000.0)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": args.draft_layers,
        "num_attention_heads": nh,
        "num_key_value_heads": tcfg.num_key_value_heads,
        "head_dim": hd,
        "intermediate_size": args.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": float(tcfg.rms_norm_eps),
        "rope_theta": float(theta),
        "rope_scaling": None,
        "max_position_embeddings": int(tcfg.max_position_embeddings),
        "vocab_size": int(tcfg.vocab_size),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * args.draft_layers,
        "initializer_range": 0.02,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "block_size": BLOCK,
        "num_target_layers": int(tcfg.num_hidden_layers),
        "dflash_config": {"mask_token_id": args.mask_id, "target_layer_ids": args.layer_ids},
    }


def export(drafter, out_dir, extra=None):
    from safetensors.torch import save_file
    tmp = out_dir + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(drafter.c, f, indent=2)
    for name, obj in (extra or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=1)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)


# ----------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf")
    ap.add_argument("--hf-dir")
    ap.add_argument("--data", required=True, help="comma-separated JSONL files (.gz: read once; others may "
                    "still grow)")
    ap.add_argument("--heldout")
    ap.add_argument("--out", required=True, help="folder: hf/ (the drafter), ckpt.pt, metrics.json")
    ap.add_argument("--layer-ids", default="", help="comma list; default: 5 spread from 1 to L-3")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--intermediate-size", type=int, default=0, help="default: the target's")
    ap.add_argument("--mask-id", type=int, default=151669)
    ap.add_argument("--draft-vocab", default="", help="JSON array of token ids: train and measure the readout "
                    "over these LM-head rows only (as eddy drafts with draft_vocab.json); exported as is")
    ap.add_argument("--train-seconds", type=float, default=600, help="wall-clock budget of the training loop "
                    "(periodic evaluations and exports included); the lr schedule runs over it")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--min-seqs", type=int, default=256, help="wait for this many sequences before training")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--schedule", choices=("cosine", "wsd"), default="cosine",
                    help="cosine: to --min-lr over the budget; wsd: constant, then cosine to --min-lr over the "
                    "last --decay-frac of the budget")
    ap.add_argument("--decay-frac", type=float, default=0.3)
    ap.add_argument("--min-lr", type=float, default=0.1, help="final lr as a fraction of --lr")
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--anchors", type=int, default=128, help="random anchors per sequence (at most)")
    ap.add_argument("--token-budget", type=int, default=32768, help="padded target tokens per step")
    ap.add_argument("--block-budget", type=int, default=1 << 30, help="blocks (anchors) per step")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1280)
    ap.add_argument("--chunk-rows", type=int, default=8192)
    ap.add_argument("--chunk-anchors", type=int, default=32, help="anchors per drafter row (a sequence's "
                    "anchors are cut into rows of this many; the padding of the last row is the only waste)")
    ap.add_argument("--new-lr-mult", type=float, default=1.0, help="lr multiplier of the layers --init-from "
                    "adds")
    ap.add_argument("--export-every", type=float, default=240, help="seconds between exports")
    ap.add_argument("--eval-batch", type=int, default=4)
    ap.add_argument("--eval-anchors", type=int, default=256)
    ap.add_argument("--eval-first", action="store_true", help="measure the starting drafter before training")
    ap.add_argument("--stop-file", default="", help="created when training ends (tells regen to stop)")
    ap.add_argument("--halt-file", default="", help="training stops (and exports) once this file exists")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt (weights, optimizer, "
                    "step, trained seconds)")
    ap.add_argument("--init-from", default="", help="start from an exported drafter folder (same shape, or fewer "
                    "layers: added layers copy its last one with o_proj/down_proj zero); the optimizer starts fresh")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)

    ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None
    target = Target(args, ids, args.device)
    probe_ids = target.layer_ids
    args.layer_ids = probe_ids
    tcfg = target.config
    if not args.intermediate_size:
        args.intermediate_size = tcfg.intermediate_size
    cfg = drafter_config(tcfg, args)
    drafter = DFlashDrafter(cfg).to(args.device)
    # the drafter's output plays the target's last hidden state: start its final norm at the target's
    # (Qwen2.5's final norm weights are far from 1; from 1, AdamW needs thousands of steps to get there)
    with torch.no_grad():
        drafter.norm.weight.copy_(target.model.model.norm.weight.float())
    nparam = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {args.draft_layers} layer(s), target layers {probe_ids}, intermediate "
        f"{args.intermediate_size}, {nparam / 1e6:.1f} M parameters")
    vocab_ids = None
    if args.draft_vocab:
        with open(args.draft_vocab) as f:
            vocab_ids = json.load(f)
        if isinstance(vocab_ids, dict):
            vocab_ids = vocab_ids["token_ids"]
    readout = Readout(target.lm_head_w, vocab_ids)
    readouts = {"draft": readout, "full": Readout(target.lm_head_w)} if vocab_ids else {"full": readout}
    if vocab_ids:
        log(f"readout: {len(vocab_ids)} draft-vocabulary rows of the LM head")

    n_init_layers = args.draft_layers
    if args.init_from:
        from safetensors.torch import load_file
        with open(os.path.join(args.init_from, "config.json")) as f:
            old = json.load(f)
        keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "dflash_config")
        bad = [k for k in keys if old.get(k) != cfg.get(k)]
        n_init_layers = old.get("num_hidden_layers", 0)
        if bad or not 1 <= n_init_layers <= args.draft_layers:
            raise SystemExit(f"--init-from {args.init_from}: its config differs from this run's in "
                             f"{bad or ['num_hidden_layers']} (a run may only add layers)")
        sd = {k: v.float() for k, v in load_file(os.path.join(args.init_from, "model.safetensors")).items()}
        # added layers: copies of the last trained layer whose o_proj and down_proj are zero, so that they
        # add nothing to the residual stream and the drafter starts as exactly the one loaded
        src = f"layers.{n_init_layers - 1}."
        for i in range(n_init_layers, args.draft_layers):
            for k in [k for k in sd if k.startswith(src)]:
                v = sd[k].clone()
                if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                    v.zero_()
                sd[f"layers.{i}." + k[len(src):]] = v
        drafter.load_state_dict(sd, strict=True)
        log(f"initialized from {args.init_from}" + (f" ({n_init_layers} layer(s); layers {n_init_layers}.."
            f"{args.draft_layers - 1} added with zero o_proj/down_proj)" if n_init_layers < args.draft_layers
            else ""))
    new_names = {n for n, _ in drafter.named_parameters()
                 if n.startswith("layers.") and int(n.split(".")[1]) >= n_init_layers}
    groups = [{"params": [p for n, p in drafter.named_parameters() if n not in new_names], "lr_mult": 1.0}]
    if new_names:
        groups.append({"params": [p for n, p in drafter.named_parameters() if n in new_names],
                       "lr_mult": args.new_lr_mult})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step, trained_s = 0, 0.0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    history = []
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=args.device)
        drafter.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, trained_s, history = ck["step"], ck["trained_s"], ck.get("history", [])
        log(f"resumed at step {step} ({trained_s:.0f} s trained)")

    heldout = load_jsonl(args.heldout) if args.heldout and os.path.exists(args.heldout) else []

    def eval_line(ev):
        return "; ".join(f"{name}: tau {r.get('all', {}).get('tau', float('nan')):.3f} (" +
                         " ".join(f"{k}={v.get('tau', 0):.3f}" for k, v in r.items() if k != "all") + ")"
                         for name, r in ev.items())

    eval_initial = {}
    if args.eval_first and heldout:
        eval_initial = evaluate(drafter, target, heldout, args, readouts)
        log(f"starting drafter on the held-out set: {eval_line(eval_initial)}")

    data = GrowingData([p for p in args.data.split(",") if p], args.max_len)
    while True:
        data.refresh(rng)
        if len(data.seqs) >= args.min_seqs:
            break
        log(f"waiting for data: {len(data.seqs)} sequences")
        time.sleep(10)

    w = torch.exp(-(torch.arange(1, BLOCK, dtype=torch.float32) - 1) / args.gamma).to(args.device)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))

    def lr_at(step, frac):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, frac)
        if args.schedule == "wsd":
            d0 = 1.0 - args.decay_frac
            if frac < d0:
                return args.lr
            frac = (frac - d0) / max(args.decay_frac, 1e-9)
        return args.lr * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * frac)))

    def save_all(final):
        nonlocal heldout
        if args.heldout and os.path.exists(args.heldout):
            heldout = load_jsonl(args.heldout)
        ev = evaluate(drafter, target, heldout, args, readouts) if heldout else {}
        main_ev = ev.get("draft", ev.get("full", {}))
        metrics = {"step": step, "trained_s": round(trained_s, 1), "sequences": len(data.seqs),
                   "tokens_seen_responses": sum(data.token_counts.values()), "eval": main_ev,
                   "eval_readouts": ev, "eval_initial": eval_initial,
                   "history": history, "params": nparam, "args": vars(args)}
        torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step,
                    "trained_s": trained_s, "history": history}, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)
        if vocab_ids is not None:
            vocab = vocab_ids
        else:
            vocab = sorted(data.token_counts, key=lambda t: -data.token_counts[t])[:32768]
        export(drafter, os.path.join(args.out, "hf"), {"metrics.json": metrics, "draft_vocab.json": vocab})
        log(f"export at step {step}{' (final)' if final else ''}: {eval_line(ev)}")

    t_train0 = time.time()
    t_last_export = time.time()
    win = []
    drafter.train()
    feed = Prefetch(data, args, rng, pin=args.device.startswith("cuda"))
    while not stop["now"]:
        elapsed = time.time() - t_train0
        if (args.max_steps and step >= args.max_steps) or elapsed >= args.train_seconds:
            break
        if args.halt_file and os.path.exists(args.halt_file):
            log("halt file found")
            break
        t0 = time.time()
        host, nseq, longest = feed.get()
        lr = lr_at(step, elapsed / args.train_seconds)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
        blocks = blocks_on_device(host, args.mask_id, args.device)
        h, labels = run_blocks(drafter, target, blocks, args)
        rows = readout.rows(labels)
        weights = w.repeat(labels.numel() // (BLOCK - 1)) * (rows != -100)
        tot, pred = chunked_ce(h, readout.w, rows, weights, args.chunk_rows)
        loss = tot / weights.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        # statistics stay on the device (no per-step synchronisation: the GPU queue never drains while the
        # host launches the next step); read back every 25 steps
        pred_t, lab = readout.tokens(pred).view(-1, BLOCK - 1), labels.view(-1, BLOCK - 1)
        full = (lab != -100).all(-1)
        acc = ((pred_t == lab) & (lab != -100)).long().cumprod(-1).sum(-1)
        tau_t = 1 + (acc * full).sum() / full.sum().clamp(min=1)
        has1 = lab[:, 0] != -100
        hit1 = ((pred_t[:, 0] == lab[:, 0]) & has1).sum() / has1.sum().clamp(min=1)
        win.append((loss.detach(), tau_t, hit1, nseq, host[4].numel()))
        trained_s += time.time() - t0
        if step % 25 == 0 or step == 1:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            l, tau, a1 = (sum(float(x[i]) for x in win) / len(win) for i in range(3))
            history.append({"step": step, "s": round(trained_s, 1), "wall": round(time.time() - t_train0, 1),
                            "loss": round(l, 4), "train_tau": round(tau, 3), "acc1": round(a1, 4), "lr": lr,
                            "seqs": len(data.seqs)})
            log(f"step {step} {trained_s:.0f}s loss {l:.4f} train-tau {tau:.3f} acc@1 {a1:.3f} lr {lr:.2e} "
                f"gn {gn.item():.2f} batch {nseq}x{longest} "
                f"anchors {sum(x[4] for x in win) // len(win)} data {len(data.seqs)}")
            win = []
        if time.time() - t_last_export > args.export_every:
            save_all(False)
            t_last_export = time.time()
    feed.close()
    if args.stop_file:
        open(args.stop_file, "w").close()
    data.refresh(rng)
    save_all(True)
    log("done")


if __name__ == "__main__":
    sys.exit(main())
