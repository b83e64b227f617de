#!/usr/bin/env python3
"""CPU checks of the DFlash training tools on a small random Qwen2 (run before spending device time):

1. train.py's drafter attention (context part + own-block part, one float32 softmax over both) equals
   attention over [context ; all block rows] with the block-diagonal mask (the formulation checked against
   z-lab's reference class), on random weights and inputs, through make_blocks' masks.
2. gen.py's batched decode loop (static per-slot cache, refills) emits exactly transformers' greedy
   `generate` tokens for every prompt, and its prefill/step logits match transformers' forward.
3. train.py runs end to end (draft-vocabulary readout, --eval-first, --init-from, export) for a few steps.

usage: python3 tools/dflash/check_train.py [WORKDIR]
"""

import json
import math
import os
import random
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen  # noqa: E402
import train  # noqa: E402


def dense_attention(attn, x, ctx, rope_q, rope_k, ctx_mask):
    """The previous formulation: SDPA over [ctx ; all block rows] with a dense [B, 1, Q, T+Q] mask."""
    B, Q, _ = x.shape
    T = ctx.shape[1]
    blk = torch.arange(Q) // train.BLOCK
    mask = torch.cat([ctx_mask, (blk[:, None] == blk[None, :])[None].expand(B, Q, Q)], dim=-1)[:, None]
    q = attn.q_norm(attn.q_proj(x).view(B, Q, attn.nh, attn.hd)).transpose(1, 2)
    k = torch.cat([attn.k_proj(ctx), attn.k_proj(x)], dim=1).view(B, T + Q, attn.nkv, attn.hd)
    k = attn.k_norm(k).transpose(1, 2)
    v = torch.cat([attn.v_proj(ctx), attn.v_proj(x)], dim=1).view(B, T + Q, attn.nkv, attn.hd).transpose(1, 2)
    q, k = train.apply_rope(q, *rope_q), train.apply_rope(k, *rope_k)
    rep = attn.nh // attn.nkv
    a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    return attn.o_proj(a.transpose(1, 2).reshape(B, Q, attn.nh * attn.hd))


def dense_blocks(seqs, anchors, mask_id, pad_id=0):
    """The previous batch layout (sessions 5-7), built on the host: one drafter row per sequence holding all
    its anchors, padded to the longest anchor list. Returns ids [B,T], block_ids [B,A*16], block_pos
    [B,A*16], labels [B,A,15] (-100 = none), ctx_mask [B,A*16,T]."""
    B = len(seqs)
    T = -(-max(len(s[0]) for s in seqs) // 16) * 16
    A = max(1, max(len(a) for a in anchors))
    BLOCK = train.BLOCK
    ids_t = torch.full((B, T), pad_id, dtype=torch.long)
    apos = torch.zeros((B, A), dtype=torch.long)
    valid = torch.zeros((B, A), dtype=torch.bool)
    labels = torch.full((B, A, BLOCK - 1), -100, dtype=torch.long)
    for b, ((ids, _pl), an) in enumerate(zip(seqs, anchors)):
        t = torch.tensor(ids, dtype=torch.long)
        ids_t[b, : len(ids)] = t
        if not an:
            continue
        a = torch.tensor(an, dtype=torch.long)
        apos[b, : len(an)] = a
        valid[b, : len(an)] = True
        idx = a[:, None] + torch.arange(1, BLOCK)[None]
        ok = idx < len(ids)
        labels[b, : len(an)] = torch.where(ok, t[idx.clamp(max=len(ids) - 1)], torch.tensor(-100))
    block_ids = torch.full((B, A, BLOCK), mask_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.gather(ids_t, 1, apos)
    block_pos = apos[:, :, None] + torch.arange(BLOCK)[None, None]
    q_anchor = (apos * valid).repeat_interleave(BLOCK, dim=1)
    ctx_mask = torch.arange(T)[None, None, :] < q_anchor[:, :, None]
    return ids_t, block_ids.view(B, A * BLOCK), block_pos.view(B, A * BLOCK), labels, ctx_mask


def check_blocks():
    """The packed layout built on the device (pack_host + blocks_on_device) against the previous host-built
    padded layout, on the same anchors: per real anchor the same block tokens, positions, labels and context
    mask; and the drafter's outputs at the real anchors agree (float64), so the loss and the acceptance are
    unchanged."""
    BLOCK = train.BLOCK
    rng = random.Random(11)
    seqs = []
    for n in range(9):
        L = rng.randrange(20, 140)
        seqs.append(([rng.randrange(1000) for _ in range(L)], rng.randrange(2, L - 3)))
    seqs.append(([5] * 12, 11))  # no anchor at all (needs a label after the anchor)
    for all_anchors, per, chunk in ((False, 40, 7), (True, 25, 32), (False, 1000, 16)):
        anchors = train.pick_anchors(seqs, per, random.Random(4), all_anchors=all_anchors)
        assert anchors == train.pick_anchors(seqs, per, random.Random(4), all_anchors=all_anchors)
        ids0, bid0, bpos0, lab0, cm0 = dense_blocks(seqs, anchors, 999)
        host = train.pack_host(seqs, anchors, chunk)
        ids1, row_seq, bid1, bpos1, lab1, cm1, vidx = train.blocks_on_device(host, 999, "cpu")
        assert torch.equal(ids0, ids1)
        R, Q = bid1.shape
        C = Q // BLOCK
        # the dense layout's real anchors, in sequence order
        sel0 = [(b, i) for b, an in enumerate(anchors) for i in range(len(an))]
        sel1 = [(vi // C, vi % C) for vi in vidx.tolist()]
        assert len(sel0) == len(sel1) == sum(host[5])
        for (b, i), (r, j) in zip(sel0, sel1):
            assert row_seq[r].item() == b
            s0, s1 = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            assert torch.equal(bid0[b, s0], bid1[r, s1]) and torch.equal(bpos0[b, s0], bpos1[r, s1])
            assert torch.equal(lab0[b, i], lab1[r, j]) and torch.equal(cm0[b, s0], cm1[r, s1])
        # empty slots carry no label and see no context
        empty = torch.ones(R * C, dtype=torch.bool)
        empty[vidx] = False
        assert (lab1.view(R * C, -1)[empty] == -100).all()
        assert not cm1.view(R * C, BLOCK, -1)[empty].any()
        # drafter outputs at the real anchors, both layouts
        torch.manual_seed(2)
        c = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "rms_norm_eps": 1e-6, "intermediate_size": 96, "num_hidden_layers": 2, "rope_theta": 10000.0,
             "dflash_config": {"target_layer_ids": [0, 1]}}
        d = train.DFlashDrafter(c).double()
        B, T = ids0.shape
        feats = torch.randn(B, T, 128, dtype=torch.float64)
        table = torch.randn(1000, 64, dtype=torch.float64)
        with torch.no_grad():
            out0 = d(feats, table[bid0], bpos0, cm0)
            out1 = d(feats, table[bid1], bpos1, cm1, row_seq)
        h0 = torch.stack([out0[b, i * BLOCK:(i + 1) * BLOCK] for b, i in sel0])
        h1 = out1.view(R * C, BLOCK, 64).index_select(0, vidx)
        e = rel(h1, h0)
        assert e < 1e-12, e
        print(f"blocks: packed device layout ({R} rows of {C} anchors) = padded host layout "
              f"({B} rows of {bid0.shape[1] // BLOCK}): {len(sel0)} anchors, same blocks/labels/masks, "
              f"drafter outputs relative error {e:.1e}")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def check_attention():
    torch.manual_seed(1)
    c = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "rms_norm_eps": 1e-6, "intermediate_size": 96, "num_hidden_layers": 2, "rope_theta": 10000.0,
         "dflash_config": {"target_layer_ids": [0, 1]}}
    d = train.DFlashDrafter(c).double()
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    rng = random.Random(3)
    seqs = [(list(range(50)), 20), (list(range(33)), 10), (list(range(41)), 30)]
    ids, block_ids, block_pos, labels, ctx_mask = dense_blocks(seqs, train.pick_anchors(seqs, 7, rng), 99)
    B, T = ids.shape
    Q = block_ids.shape[1]
    # the masks: every block row sees exactly the context strictly before its anchor
    anchors = block_pos[:, ::train.BLOCK]
    for b in range(B):
        for qi in range(Q):
            a = anchors[b, qi // train.BLOCK].item()
            valid = labels[b, qi // train.BLOCK, 0].item() != -100
            want = torch.arange(T) < (a if valid else 0)
            assert torch.equal(ctx_mask[b, qi], want), (b, qi)
    x = torch.randn(B, Q, 64, dtype=torch.float64)
    ctx = torch.randn(B, T, 64, dtype=torch.float64)
    ctx_pos = torch.arange(T)[None].expand(B, T)
    rope_q = train.rope_cos_sin(block_pos, 16, 10000.0)
    rope_k = train.rope_cos_sin(torch.cat([ctx_pos, block_pos], 1), 16, 10000.0)
    rope_q = tuple(t.double() for t in rope_q)
    rope_k = tuple(t.double() for t in rope_k)
    attn = d.layers[0].self_attn
    with torch.no_grad():
        new = attn(x, ctx, rope_q, rope_k, ctx_mask)
        ref = dense_attention(attn, x, ctx, rope_q, rope_k, ctx_mask)
    e = rel(new, ref)
    print(f"attention: two-part vs dense-mask reference, float64: relative error {e:.2e}")
    assert e < 1e-10, e
    g = torch.randn_like(ref)
    attn.zero_grad()
    (attn(x, ctx, rope_q, rope_k, ctx_mask) * g).sum().backward()
    g1 = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()
    (dense_attention(attn, x, ctx, rope_q, rope_k, ctx_mask) * g).sum().backward()
    e = max(rel(a, p.grad) for a, p in zip(g1, attn.parameters()))
    print(f"attention: parameter gradients, two-part vs dense-mask reference, float64: relative error {e:.2e}")
    assert e < 1e-10, e
    # whole drafter, float32, under CPU autocast off
    d = d.float()
    feats = torch.randn(B, T, 128)
    emb = torch.randn(B, Q, 64)
    with torch.no_grad():
        out = d(feats, emb, block_pos, ctx_mask)
    # reference drafter: same weights, dense attention
    with torch.no_grad():
        ctxr = d.hidden_norm(d.fc(feats))
        rq = train.rope_cos_sin(block_pos, 16, 10000.0)
        rk = train.rope_cos_sin(torch.cat([ctx_pos, block_pos], 1), 16, 10000.0)
        h = emb
        for ly in d.layers:
            h = h + dense_attention(ly.self_attn, ly.input_layernorm(h), ctxr, rq, rk, ctx_mask)
            h = h + ly.mlp(ly.post_attention_layernorm(h))
        ref = d.norm(h)
    e = rel(out, ref)
    print(f"drafter forward: two-part vs dense-mask attention, float32: relative error {e:.2e}")
    assert e < 1e-5, e


def tiny_qwen2(work):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    path = os.path.join(work, "tiny-qwen2")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init: greedy paths that are not ties
        for n, p in m.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif "bias" in n:
                p.normal_(0, 0.2)
    m.save_pretrained(path)
    return path


def check_gen(work):
    from transformers import AutoModelForCausalLM
    path = tiny_qwen2(work)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts = [{"id": f"p{i}", "src": "test", "ids": [rng.randrange(1000) for _ in range(rng.randrange(2, 40))]}
               for i in range(11)]
    # logits of prefill + steps against transformers' forward
    fm = gen.FastQwen2(m, 3, 80, "cpu", torch.float32)
    ps = [p["ids"] for p in prompts[:3]]
    with torch.no_grad():
        lg = fm.prefill([2, 0, 1], ps)
        worst = 0.0
        for i, p in enumerate(ps):
            ref = m(torch.tensor([p])).logits[0, -1]
            worst = max(worst, rel(lg[i], ref))
        toks = [[p[-1] * 0 + (7 + i)] for i, p in enumerate(ps)]  # one more token each
        slot_of = [2, 0, 1]
        tok = torch.zeros(3, dtype=torch.long)
        pos = torch.zeros(3, dtype=torch.long)
        for i, p in enumerate(ps):
            tok[slot_of[i]] = toks[i][0]
            pos[slot_of[i]] = len(p)
        lg2 = fm.step(tok, pos, 64)
        for i, p in enumerate(ps):
            ref = m(torch.tensor([p + toks[i]])).logits[0, -1]
            worst = max(worst, rel(lg2[slot_of[i]], ref))
    print(f"gen: prefill and decode-step logits vs transformers' forward: worst relative error {worst:.2e}")
    assert worst < 1e-4, worst
    # the whole loop with refills (3 slots, 11 prompts) against greedy generate
    pf = os.path.join(work, "prompts.jsonl")
    with open(pf, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    out = os.path.join(work, "gen.jsonl")
    if os.path.exists(out):
        os.remove(out)
    subprocess.run([sys.executable, os.path.join(HERE, "gen.py"), "--hf-dir", path, "--prompts", pf, "--out", out,
                    "--slots", "3", "--max-new", "24", "--max-prompt", "48", "--refill", "5", "--prefill-batch", "2",
                    "--sampled-frac", "0", "--max-prompts", "11", "--device", "cpu", "--dtype", "float32"],
                   check=True)
    rows = [json.loads(x) for x in open(out)]
    assert sorted(r["id"] for r in rows) == sorted(p["id"] for p in prompts), [r["id"] for r in rows]
    for r in rows:
        ref = m.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=24, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(r["prompt_ids"]):].tolist()
        assert r["response_ids"] == ref, (r["id"], r["response_ids"], ref)
        assert r["stop"] == "limit"
    print(f"gen: {len(rows)} responses through 3 slots with refills equal transformers' greedy generate")
    # sampled mode runs and stays in the top-k
    out2 = os.path.join(work, "gen2.jsonl")
    if os.path.exists(out2):
        os.remove(out2)
    subprocess.run([sys.executable, os.path.join(HERE, "gen.py"), "--hf-dir", path, "--prompts", pf, "--out", out2,
                    "--slots", "4", "--max-new", "16", "--max-prompt", "48", "--sampled-frac", "1",
                    "--max-prompts", "6", "--device", "cpu", "--dtype", "float32"], check=True)
    rows2 = [json.loads(x) for x in open(out2)]
    assert len(rows2) == 6 and all(r["mode"] == "sampled" and len(r["response_ids"]) == 16 for r in rows2)
    r = rows2[0]
    seq = r["prompt_ids"]
    for t in r["response_ids"]:
        top = m(torch.tensor([seq])).logits[0, -1].topk(20).indices.tolist()
        assert t in top
        seq = seq + [t]
    print("gen: sampled responses stay within the top-20")
    return path


def check_train_runs(work, model_dir):
    # data: greedy responses of the tiny model
    data = os.path.join(work, "gen.jsonl")
    held = os.path.join(work, "held.jsonl")
    rows = [json.loads(x) for x in open(data)]
    with open(held, "w") as f:
        for r in rows[:4]:
            f.write(json.dumps({**r, "src": "a" if r["id"] < "p5" else "b"}) + "\n")
    vocab = os.path.join(work, "vocab.json")
    counts = {}
    for r in rows:
        for t in r["response_ids"]:
            counts[t] = counts.get(t, 0) + 1
    ids = sorted(counts, key=lambda t: -counts[t])[:60]
    json.dump(ids, open(vocab, "w"))
    base = [sys.executable, os.path.join(HERE, "train.py"), "--hf-dir", model_dir, "--data", data, "--heldout", held,
            "--mask-id", "1000", "--intermediate-size", "96", "--min-seqs", "4", "--device", "cpu",
            "--anchors", "16", "--token-budget", "256", "--eval-anchors", "8", "--layer-ids", "0,1,2"]
    o1 = os.path.join(work, "run1")
    subprocess.run(base + ["--out", o1, "--max-steps", "3", "--train-seconds", "100"], check=True)
    o2 = os.path.join(work, "run2")
    subprocess.run(base + ["--out", o2, "--max-steps", "4", "--train-seconds", "100", "--init-from",
                           os.path.join(o1, "hf"), "--draft-vocab", vocab, "--eval-first", "--schedule", "wsd",
                           "--block-budget", "40"], check=True)
    met = json.load(open(os.path.join(o2, "hf", "metrics.json")))
    assert met["step"] == 4 and set(met["eval_readouts"]) == {"draft", "full"} and met["eval_initial"]
    assert json.load(open(os.path.join(o2, "hf", "draft_vocab.json"))) == ids
    # init-from: the starting drafter measured in run 2 is run 1's final one (same full-vocab tau)
    m1 = json.load(open(os.path.join(o1, "hf", "metrics.json")))
    t1, t2 = m1["eval_readouts"]["full"]["all"]["tau"], met["eval_initial"]["full"]["all"]["tau"]
    print(f"train: runs end to end; run 1 final tau {t1:.4f}, run 2 starting tau {t2:.4f}")
    assert abs(t1 - t2) < 0.05, (t1, t2)
    # init-from a 1-layer drafter into 2 layers: the added layer starts with zero o_proj/down_proj, so the
    # starting drafter is the loaded one (same acceptance on every readout), and training moves the new layer
    o3 = os.path.join(work, "run3")
    subprocess.run(base + ["--out", o3, "--max-steps", "3", "--train-seconds", "100", "--init-from",
                           os.path.join(o2, "hf"), "--draft-vocab", vocab, "--eval-first", "--draft-layers", "2",
                           "--new-lr-mult", "2", "--lr", "1e-3", "--warmup", "1"], check=True)
    m3 = json.load(open(os.path.join(o3, "hf", "metrics.json")))
    for ro in ("draft", "full"):
        a, b = met["eval_readouts"][ro]["all"], m3["eval_initial"][ro]["all"]
        assert a["tau"] == b["tau"] and a["p_accept_ge_k"] == b["p_accept_ge_k"], (ro, a, b)
    from safetensors.torch import load_file
    w3 = load_file(os.path.join(o3, "hf", "model.safetensors"))
    assert json.load(open(os.path.join(o3, "hf", "config.json")))["num_hidden_layers"] == 2
    assert w3["layers.1.self_attn.o_proj.weight"].abs().max() > 0 and w3["layers.1.mlp.down_proj.weight"].abs().max() > 0
    print(f"train: 1 -> 2 layers: starting tau {m3['eval_initial']['draft']['all']['tau']:.4f} = run 2's final; "
          f"the added layer trains")


def main():
    work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dflash-check"
    os.makedirs(work, exist_ok=True)
    check_attention()
    check_blocks()
    path = check_gen(work)
    check_train_runs(work, path)
    print("all checks passed")


if __name__ == "__main__":
    main()
