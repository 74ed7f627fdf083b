#!/usr/bin/env python3
"""Train a DFlash 2 drafter for a GGUF target, on a CPU (or a GPU when there is one).

Input: the target GGUF (its token embeddings and output head, which the drafter borrows)
and a dataset written by `dflash2 dataset` (target features and greedy labels, read off
the quantized target itself). Output: a checkpoint directory in z-lab's layout
(config.json with "dflash_config" + model.safetensors) that `dflash2 convert` turns into
a GGUF drafter.

The model is the graph llama.cpp runs (src/models/dflash.cpp of the bundled tree), term
for term: target features -> fc -> RMSNorm form each layer's context K/V; the block
[anchor, MASK...] attends to that context and to itself (not causally); DFlash 2 adds
grouped dynamic causal convolutions around attention and FFN and a candidate selector
S_t(a, c) = logit_t(c) + <P[a] * H h_t, N[c]> over the top-K candidates of each position.

Training (DFlash recipe): random anchors in the target-written part of each sequence,
context = the features of every token before the anchor, labels = the target's own greedy
tokens; cross-entropy weighted exp(-(k-1)/gamma) by block position k, none on the anchor
slot; the selector by cross-entropy over the top-K candidates with the true predecessor.
An optional reduced draft vocabulary (d2t: the most frequent target tokens) keeps the
output head cheap to train and to run.

Deterministic for a seed; resumable (state saved every --save-every steps in --work);
prints progress and loss.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import save_file


# ----------------------------------------------------------------------------- target

def load_target(path):
    """Token embeddings and output head of the GGUF target (dequantized), and its shape."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    tensors = {t.name: t for t in r.tensors}

    def matrix(name):
        t = tensors[name]
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    embd = matrix("token_embd.weight")
    head = matrix("output.weight") if "output.weight" in tensors else embd
    field = r.fields.get(f"{arch}.rope.freq_base")
    rope = float(field.contents()) if field is not None else 10000.0
    n_layer = int(r.fields[f"{arch}.block_count"].contents())
    return embd, head, rope, n_layer


def init_from_target(model, path, target_layers):
    """Copy target layers' weights into the drafter's layers where the shapes fit: the two norms,
    the V and O projections and the FFN. Q and K are left as they are (llama.cpp's GGUF stores a
    llama target's Q/K rows permuted for its rope layout, which the drafter does not use)."""
    import gguf

    if len(target_layers) != len(model.layers):
        sys.exit(f"error: --init-from-target names {len(target_layers)} layers for a {len(model.layers)}-layer drafter")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    pairs = {
        "attn_norm": lambda l: l.input_layernorm.weight, "ffn_norm": lambda l: l.post_attention_layernorm.weight,
        "attn_v": lambda l: l.self_attn.v_proj.weight, "attn_output": lambda l: l.self_attn.o_proj.weight,
        "ffn_gate": lambda l: l.mlp.gate_proj.weight, "ffn_up": lambda l: l.mlp.up_proj.weight,
        "ffn_down": lambda l: l.mlp.down_proj.weight,
    }
    copied, skipped = 0, []
    for layer, il in zip(model.layers, target_layers):
        for name, param in pairs.items():
            t = tensors.get(f"blk.{il}.{name}.weight")
            if t is None:
                skipped.append(f"blk.{il}.{name} (absent)")
                continue
            w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            dst = param(layer)
            if tuple(w.shape) != tuple(dst.shape):
                skipped.append(f"blk.{il}.{name} {tuple(w.shape)} vs {tuple(dst.shape)}")
                continue
            dst.copy_(w)
            copied += 1
    print(f"initialised from target layers {target_layers}: {copied} tensors copied"
          + (f", skipped {', '.join(skipped)}" if skipped else ""), file=sys.stderr)


def init_from_drafter(model, path):
    """Start from a converted drafter GGUF (the shipped one, say): every tensor back under the
    checkpoint name `dflash2 convert` read it from (q8_0 dequantized), and its draft vocabulary
    (d2t), returned. A session that lost its checkpoint continues from the shipped weights
    (a warm restart: the optimizer state is not in the GGUF)."""
    import gguf

    names = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
             "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight",
             "token_embd.weight": "embed_tokens.weight",
             "selector_predecessor.weight": "candidate_selector.predecessor_codebook.weight",
             "selector_successor.weight": "candidate_selector.successor_codebook.weight",
             "selector_hidden.weight": "candidate_selector.hidden_projection.weight"}
    per_layer = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                 "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
                 "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
                 "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight", "attn_conv_base": "attention_conv.base_kernel",
                 "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
                 "ffn_conv_base": "mlp_conv.base_kernel", "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight"}
    sd = model.state_dict()
    seen, d2t = set(), None
    for t in gguf.GGUFReader(path).tensors:
        if t.name == "d2t":
            d2t = torch.from_numpy(np.array(t.data, dtype=np.int64))
            continue
        if t.name.startswith("blk."):
            _, il, rest = t.name.split(".", 2)
            key = f"layers.{il}.{per_layer.get(rest, rest)}"
        else:
            key = names.get(t.name, t.name)
        if key not in sd:
            sys.exit(f"error: {path}: tensor {t.name} has no place in this drafter ({key})")
        w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if w.numel() != sd[key].numel():
            sys.exit(f"error: {path}: {t.name} has {tuple(w.shape)}, the drafter's {key} {tuple(sd[key].shape)}: "
                     "pass the architecture flags it was trained with")
        sd[key].copy_(w.reshape(sd[key].shape))
        seen.add(key)
    missing = sorted(set(sd) - seen)
    if missing:
        sys.exit(f"error: {path} lacks {', '.join(missing)}")
    print(f"initialised from drafter {path}: {len(seen)} tensors", file=sys.stderr)
    return d2t


# ----------------------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, pos, base):
    """NeoX rotary embedding (llama.cpp's rope type for dflash): x [..., n, heads, hd], pos [..., n]."""
    hd = x.shape[-1]
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    ang = pos.to(torch.float32)[..., None] * inv  # [..., n, hd/2]
    cos, sin = ang.cos()[..., None, :].to(x.dtype), ang.sin()[..., None, :].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DynamicConv(nn.Module):
    """Grouped dynamic causal convolution over the positions of each block."""

    def __init__(self, hidden, kernel, group):
        super().__init__()
        self.kernel, self.groups, self.group = kernel, hidden // group, group
        base = torch.zeros(2, kernel, hidden)
        base[:, 0, :] = 1.0  # starts as the identity
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x):
        """x [m, B, E] -> (side-0 conv of x, the dynamic taps kept for side 1)."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, self.groups)
        return self.convolve(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def convolve(self, x, dyn, side):
        m, b, e = x.shape
        out = torch.zeros_like(x)
        for tap in range(min(self.kernel, b)):
            vals = x if tap == 0 else F.pad(x[:, : b - tap], (0, 0, tap, 0))
            w = dyn[:, :, tap, :].repeat_interleave(self.group, dim=-1) + self.base_kernel[side, tap]
            out = out + w * vals
        return out


class Layer(nn.Module):
    def __init__(self, c, dflash2):
        super().__init__()
        e, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        eps = c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(e, eps)
        self.post_attention_layernorm = RMSNorm(e, eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(e, self.nh * hd, bias=False)
        a.k_proj = nn.Linear(e, self.nkv * hd, bias=False)
        a.v_proj = nn.Linear(e, self.nkv * hd, bias=False)
        a.o_proj = nn.Linear(self.nh * hd, e, bias=False)
        a.q_norm = RMSNorm(hd, eps)
        a.k_norm = RMSNorm(hd, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(e, c["intermediate_size"], bias=False)
        self.mlp.up_proj = nn.Linear(e, c["intermediate_size"], bias=False)
        self.mlp.down_proj = nn.Linear(c["intermediate_size"], e, bias=False)
        if dflash2:
            d = c["dflash_config"]
            self.attention_conv = DynamicConv(e, d["conv_kernel_size"], d["conv_group_size"])
            self.mlp_conv = DynamicConv(e, d["conv_kernel_size"], d["conv_group_size"])
        else:
            self.attention_conv = self.mlp_conv = None

    def context_kv(self, ctx, pos, base):
        """K/V of the injected context rows ctx [S, T, E] (what llama.cpp writes into the cache)."""
        a = self.self_attn
        s, t, _ = ctx.shape
        k = a.k_norm(a.k_proj(ctx).view(s, t, self.nkv, self.hd))
        v = a.v_proj(ctx).view(s, t, self.nkv, self.hd)
        return rope(k, pos, base), v

    def forward(self, x, pos, ctx_kv, mask, base):
        """x [S, m, B, E]: m blocks of each of S sequences; pos [S, m*B]; ctx_kv (K, V) [S, T, kv, hd];
        mask [S, m*B, T+m*B] (True = attend). The convolutions run along each block's B rows."""
        s, m, b, e = x.shape
        a = self.self_attn
        h = self.input_layernorm(x).view(s * m, b, e)
        dyn = None
        if self.attention_conv is not None:
            h, dyn = self.attention_conv.prepare(h)
        h = h.reshape(s, m * b, e)
        q = rope(a.q_norm(a.q_proj(h).view(s, m * b, self.nh, self.hd)), pos, base)
        k = rope(a.k_norm(a.k_proj(h).view(s, m * b, self.nkv, self.hd)), pos, base)
        v = a.v_proj(h).view(s, m * b, self.nkv, self.hd)
        k = torch.cat([ctx_kv[0], k], 1)
        v = torch.cat([ctx_kv[1], v], 1)
        rep = self.nh // self.nkv  # q head i reads kv head i // rep, as llama.cpp does
        k = k.repeat_interleave(rep, dim=2).transpose(1, 2)
        v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=self.hd ** -0.5)
        o = a.o_proj(o.transpose(1, 2).reshape(s, m * b, -1)).view(s * m, b, e)
        if dyn is not None:
            o = self.attention_conv.convolve(o, dyn, 1)
        x = x + o.view(s, m, b, e)
        h = self.post_attention_layernorm(x).view(s * m, b, e)
        if self.mlp_conv is not None:
            h, dyn = self.mlp_conv.prepare(h)
        f = self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))
        if self.mlp_conv is not None:
            f = self.mlp_conv.convolve(f, dyn, 1)
        return x + f.view(s, m, b, e)


class Drafter(nn.Module):
    def __init__(self, c, n_feat_in, n_vocab, draft_vocab):
        super().__init__()
        d = c["dflash_config"]
        self.c = c
        self.dflash2 = d.get("selector_top_k", 0) > 0
        e, eps = c["hidden_size"], c["rms_norm_eps"]
        self.fc = nn.Linear(n_feat_in, e, bias=False)
        self.hidden_norm = RMSNorm(e, eps)
        self.layers = nn.ModuleList([Layer(c, self.dflash2) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(e, eps)
        self.lm_head = nn.Linear(e, draft_vocab, bias=False)
        if self.dflash2:
            r = d["selector_rank"]
            self.candidate_selector = nn.Module()
            s = self.candidate_selector
            s.predecessor_codebook = nn.Embedding(n_vocab, r)
            s.successor_codebook = nn.Embedding(n_vocab, r)
            s.hidden_projection = nn.Linear(e, r, bias=False)
            nn.init.normal_(s.predecessor_codebook.weight, std=1.0)
            nn.init.zeros_(s.successor_codebook.weight)  # starts as the unary scores alone
            nn.init.normal_(s.hidden_projection.weight, std=e ** -0.5)
        for name, p in self.named_parameters():
            if p.dim() == 2 and "codebook" not in name and "hidden_projection" not in name and "kernel_projection" not in name:
                nn.init.normal_(p, std=0.02)

    def forward(self, features, anchors, tok_embd, tokens, mask_id, block):
        """features [S, T, F] and tokens [S, T] of S sequences (padded at the end: a row at or after
        an anchor is never seen); anchors [S, m] positions (context = the rows before each).
        Returns the final normed hidden rows [S*m, block, E] and the draft logits [S*m, block, V]."""
        base = self.c["rope_theta"]
        s, t, _ = features.shape
        m = anchors.shape[1]
        ctx = self.hidden_norm(self.fc(features))
        dev = features.device
        ctx_pos = torch.arange(t, device=dev)
        offs = torch.arange(block, device=dev)
        blk_pos = (anchors[..., None] + offs).reshape(s, m * block)
        ids = torch.full((s, m, block), mask_id, dtype=torch.long, device=dev)
        ids[..., 0] = tokens.gather(1, anchors)
        x = tok_embd[ids]
        # block i sees the context rows before its anchor and every row of its own block
        see_ctx = ctx_pos < anchors.repeat_interleave(block, dim=1)[..., None]
        blk_id = torch.arange(m, device=dev).repeat_interleave(block)
        see_blk = (blk_id[:, None] == blk_id[None, :]).expand(s, -1, -1)
        mask = torch.cat([see_ctx, see_blk], 2)
        for layer in self.layers:
            x = layer(x, blk_pos, layer.context_kv(ctx, ctx_pos, base), mask, base)
        h = self.norm(x).view(s * m, block, -1)
        return h, self.lm_head(h)

    def selector_scores(self, h, cand_ids, pred_ids):
        """S(a, c) for predecessors pred_ids [..., P] and candidates cand_ids [..., K] at hidden h [..., E]:
        the pairwise term only, [..., P, K] (the unary logits are added by the caller)."""
        s = self.candidate_selector
        gate = s.hidden_projection(h)  # [..., r]
        p = s.predecessor_codebook(pred_ids) * gate[..., None, :]
        n = s.successor_codebook(cand_ids)
        return torch.einsum("...pr,...kr->...pk", p, n)


# ----------------------------------------------------------------------------- data

class Data:
    """Training rows of one target: per token the token, the target's greedy next token, the
    target's features (and optionally its top-K law), with sequence bounds (start, end, first
    anchor). Read from one or more `dflash2 dataset` files, or built in memory (gpu_campaign.py)."""

    def __init__(self, paths, val_fraction, seed, min_len):
        if isinstance(paths, str):
            paths = [paths]
        tokens, nxt, feats, seqs, meta = [], [], [], [], None
        topk_ids, topk_lp = [], []
        base = 0
        for path in paths:
            t = np_load_file(path)
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                m = json.loads(f.read(n)).get("__metadata__", {})
            keys = ("target_layers", "n_embd", "mask_token_id")
            if meta is not None and any(m.get(k) != meta.get(k) for k in keys):
                sys.exit(f"error: {path} was read off another target or other layers than {paths[0]}")
            meta = m
            tokens.append(t["tokens"].astype(np.int64))
            nxt.append(t["next"].astype(np.int64))
            feats.append(t["features"])
            if "topk_ids" in t:  # soft labels (`dflash2 dataset --soft-k`)
                topk_ids.append(t["topk_ids"].astype(np.int64))
                topk_lp.append(t["topk_logprobs"])
            off, ans = t["offsets"], t["answer_start"]
            for i in range(len(ans)):
                seqs.append((base + int(off[i]), base + int(off[i + 1]), base + int(ans[i])))
            base += len(t["tokens"])
        self.offsets = [0] + [q[1] for q in seqs]  # every sequence's bounds, before min_len filters any
        # soft labels only when every file has them with the same K (else hard labels alone)
        soft = len(topk_ids) == len(paths) and len({a.shape[1] for a in topk_ids}) == 1
        self._setup(meta, torch.from_numpy(np.concatenate(tokens)), torch.from_numpy(np.concatenate(nxt)),
                    torch.from_numpy(np.concatenate(feats)) if len(feats) > 1 else torch.from_numpy(feats[0]),
                    torch.from_numpy(np.concatenate(topk_ids)) if soft else None,
                    torch.from_numpy(np.concatenate(topk_lp)) if soft else None,
                    seqs, val_fraction, seed, min_len)

    @classmethod
    def from_arrays(cls, meta, tokens, nxt, features, topk_ids, topk_lp, seqs, val_fraction, seed, min_len,
                    val_seqs=None):
        """The same rows from tensors (any device); `val_seqs` fixes the held-out sequences."""
        self = cls.__new__(cls)
        self._setup(meta, tokens, nxt, features, topk_ids, topk_lp, seqs, val_fraction, seed, min_len, val_seqs)
        return self

    def _setup(self, meta, tokens, nxt, features, topk_ids, topk_lp, seqs, val_fraction, seed, min_len,
               val_seqs=None):
        self.meta, self.tokens, self.next, self.features = meta, tokens, nxt, features
        self.topk_ids, self.topk_lp = topk_ids, topk_lp
        # agree[i]: the target's greedy token after i-1 is token i, i.e. the text up to i is a
        # path the target itself would take. A label at block position k is the target's
        # own continuation only where every earlier block token agrees (target-written
        # answers agree almost everywhere; other text where the target would write it too).
        self.agree = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
        self.agree[1:] = nxt[:-1] == tokens[1:]
        seqs = [q for q in seqs if q[1] - q[0] >= min_len]
        if val_seqs is not None:
            held = set(val_seqs)
            self.val = [q for q in seqs if q in held]
            self.train = [q for q in seqs if q not in held]
            return
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(seqs))
        # held-out: chat rows only (their answers are what the engine drafts at inference)
        chat = [i for i in order if seqs[i][2] - seqs[i][0] > 1]
        n_val = int(round(len(chat) * val_fraction)) if len(chat) > 1 else 0
        val = set(chat[:n_val])
        self.val = [seqs[i] for i in chat[:n_val]]
        self.train = [seqs[i] for i in order if i not in val]

    def answer_labels(self, seqs):
        return torch.cat([self.next[a:e] for (_, e, a) in seqs]).cpu()

    def rows(self, seqs, dev):
        """Flat row indices [S, T] of S sequences, each padded to the longest by repeating its last
        row (a pad row is never attended: it lies at or after every anchor of its sequence)."""
        starts = torch.tensor([q[0] for q in seqs], device=dev)
        lens = torch.tensor([q[1] - q[0] for q in seqs], device=dev)
        t = int(lens.max())
        return starts[:, None] + torch.minimum(torch.arange(t, device=dev), lens[:, None] - 1)

    def take(self, name, idx, dev):
        src = getattr(self, name)
        return src[idx.to(src.device)].to(dev)


# ----------------------------------------------------------------------------- steps

def drafted(model, data, seqs, anchors, block, tok_embd, mask_id):
    """The drafter on blocks at `anchors` [S, m] of sequences `seqs`: hidden rows and logits
    [S*m, block, .], the anchor tokens [S*m] and the flat label rows [S*m, block-1] (block
    position k's label is the target's greedy token after row anchor+k-1)."""
    dev = tok_embd.device
    idx = data.rows(seqs, dev)
    anchors = anchors.to(dev)
    feats = data.take("features", idx, dev).float()
    toks = data.take("tokens", idx, dev)
    h, logits = model(feats, anchors, tok_embd, toks, mask_id, block)
    k = torch.arange(1, block, device=dev)
    label_rows = (idx[:, :1] + anchors)[..., None] + k - 1
    return h, logits, toks.gather(1, anchors).reshape(-1), label_rows.reshape(-1, block - 1)


def block_losses(model, data, seqs, anchors, block, tok_embd, mask_id, t2d, d2t, gamma, top_k, soft_weight=0.0):
    """Losses of the blocks at `anchors` [S, m] of sequences `seqs`: (weighted token CE, selector
    CE, stats). With soft labels and `soft_weight` > 0, the token loss mixes the hard CE with the
    cross-entropy to the target's own top-K law (renormalised over its K most likely tokens):
    distillation, more signal per token."""
    dev = tok_embd.device
    h, logits, anchor_toks, rows = drafted(model, data, seqs, anchors, block, tok_embd, mask_id)
    k = torch.arange(1, block, device=dev)
    labels, on_path = block_labels(data, rows, dev)
    dl = t2d[labels]  # -1 where outside the draft vocabulary
    lg = logits[:, 1:].float()
    w = torch.exp(-(k.float() - 1) / gamma)[None, :].expand_as(dl)
    valid = (dl >= 0) & on_path
    ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), dl.clamp(min=0).reshape(-1), reduction="none").view_as(dl)
    tok_loss = (ce * w * valid).sum() / (w * valid).sum().clamp(min=1e-6)
    if soft_weight > 0 and data.topk_ids is not None:
        tk = t2d[data.take("topk_ids", rows, dev)]  # [n, block-1, K] draft rows, -1 outside
        p = torch.softmax(data.take("topk_lp", rows, dev).float(), -1) * (tk >= 0)
        logq = F.log_softmax(lg, -1).gather(-1, tk.clamp(min=0))
        soft = -(p * logq).sum(-1)
        soft_loss = (soft * w * on_path).sum() / (w * on_path).sum().clamp(min=1e-6)
        tok_loss = (1 - soft_weight) * tok_loss + soft_weight * soft_loss
    stats = {"acc1": ((lg[:, 0].argmax(-1) == dl[:, 0]) & valid[:, 0]).float().mean().item()}
    sel_loss = torch.zeros((), device=dev)
    if model.dflash2:
        with torch.no_grad():
            cand_d = lg.topk(top_k, dim=-1).indices  # [n, block-1, K] draft rows
        cand = d2t[cand_d]
        unary = lg.gather(-1, cand_d).detach()
        prev = torch.cat([anchor_toks[:, None], labels[:, :-1]], 1)  # true predecessors
        pair = model.selector_scores(h[:, 1:].float(), cand, prev[..., None])[..., 0, :]  # [n, block-1, K]
        score = unary + pair
        hit = cand == labels[..., None]
        has = hit.any(-1) & on_path
        tgt = hit.float().argmax(-1)
        sce = F.cross_entropy(score.reshape(-1, top_k), tgt.reshape(-1), reduction="none").view_as(tgt)
        sel_loss = (sce * w * has).sum() / (w * has).sum().clamp(min=1e-6)
        stats["in_topk"] = has.float().mean().item()
    return tok_loss, sel_loss, stats


@torch.no_grad()
def block_labels(data, rows, dev):
    """Labels at flat label rows [n, block-1] (see `drafted`); `on_path` says where a label is the
    target's own continuation of its block (every earlier block token agrees, see Data.agree)."""
    labels = data.take("next", rows, dev)
    agree = data.take("agree", rows + 1, dev)  # token a+k agrees
    # position 1 always; position k when tokens a+1 .. a+k-1 agree
    on_path = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1].long().cumprod(1).bool()], 1)
    return labels, on_path


@torch.no_grad()
def evaluate(model, data, seqs, block, tok_embd, mask_id, d2t, top_k, seed, per_seq=8):
    """Mean accepted length (tau, incl. the bonus token) of a greedy draft and, for DFlash 2,
    of the selector's greedy walk, on held-out anchors, as the engine's greedy verify counts it."""
    rng = np.random.default_rng(seed)
    tau_arg, tau_walk, n = 0.0, 0.0, 0
    for seq in seqs:
        s, e, a0 = seq
        hi = (e - s) - block + 1
        lo = a0 - s
        if hi <= lo:
            continue
        anchors = torch.from_numpy(np.sort(rng.choice(np.arange(lo, hi), size=min(per_seq, hi - lo), replace=False)))
        h, logits, prev, rows = drafted(model, data, [seq], anchors[None], block, tok_embd, mask_id)
        labels, on_path = block_labels(data, rows, tok_embd.device)
        labels = torch.where(on_path, labels, -1)  # past a disagreement nothing counts
        lg = logits[:, 1:].float()
        greedy = d2t[lg.argmax(-1)]
        tau_arg += accepted(greedy, labels).sum().item()
        if model.dflash2:
            cand_d = lg.topk(top_k, dim=-1).indices
            cand = d2t[cand_d]
            unary = lg.gather(-1, cand_d)
            path = []
            for p in range(block - 1):
                sc = unary[:, p] + model.selector_scores(h[:, p + 1].float(), cand[:, p], prev[:, None])[:, 0, :]
                prev = cand[:, p].gather(-1, sc.argmax(-1, keepdim=True))[:, 0]
                path.append(prev)
            tau_walk += accepted(torch.stack(path, 1), labels).sum().item()
        n += anchors.shape[0]
    n = max(n, 1)
    return 1 + tau_arg / n, (1 + tau_walk / n) if model.dflash2 else None


def accepted(draft, labels):
    return (draft == labels).long().cumprod(1).sum(1)


# ----------------------------------------------------------------------------- main

def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target GGUF")
    ap.add_argument("--data", required=True, nargs="+", help="datasets from `dflash2 dataset` (same target and layers)")
    ap.add_argument("--out", required=True, help="checkpoint directory to write (config.json + model.safetensors)")
    ap.add_argument("--work", help="state directory for resuming (default: OUT/.state)")
    ap.add_argument("--layers", type=int, default=2, help="drafter layers")
    ap.add_argument("--hidden", type=int, default=0, help="drafter width (default: the target's)")
    ap.add_argument("--heads", type=int, default=0, help="attention heads (default: width / 64)")
    ap.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: heads / 3 if it divides, else heads)")
    ap.add_argument("--ffn", type=int, default=0, help="FFN width (default: 8/3 x width, rounded to 64)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=16, help="selector candidates per position (0: a DFlash 1 drafter)")
    ap.add_argument("--rank", type=int, default=64, help="selector rank")
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--conv-group", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (0: the full vocabulary)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=0, help="stop after this much training time (0: no limit)")
    ap.add_argument("--blocks-per-step", type=int, default=32, help="blocks drawn from each sequence of a step")
    ap.add_argument("--seqs-per-step", type=int, default=1,
                    help="sequences per step (neighbours in length, padded together: a GPU wants many)")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast (CUDA)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--gamma", type=float, default=0, help="position decay (default 7 for block 16, 4 for 8)")
    ap.add_argument("--init-from-drafter", default="",
                    help="start from a drafter GGUF of the same shape (weights and draft vocabulary; not on resume)")
    ap.add_argument("--init-from-target", default="",
                    help="target layers (comma-separated, one per drafter layer) to start the drafter's layers from: "
                         "their norms, V/O projections and FFN where the shapes fit (Q/K stay random: the target's "
                         "rope layout is not the drafter's); a fresh run only")
    ap.add_argument("--soft-weight", type=float, default=0.5,
                    help="share of the distillation loss where the data has soft labels (0: hard labels only)")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: cuda when there is one)")
    return ap


def main():
    args = parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok_embd, head, rope_base, _ = load_target(args.target)
    data = Data(args.data, args.val_fraction, args.seed, min_len=args.block + 2)
    train(args, data, tok_embd, head, rope_base)


def train(args, data, tok_embd, head, rope_base, deadline=None):
    """The training run on `data` (resumable in --work), ending with the checkpoint in --out.
    `deadline` (time.time()) stops it early, as --minutes does."""
    torch.manual_seed(args.seed)
    work = args.work or os.path.join(args.out, ".state")
    os.makedirs(work, exist_ok=True)
    n_vocab, n_embd_t = tok_embd.shape
    if data.topk_ids is not None and args.soft_weight > 0:
        print(f"soft labels: the target's top-{data.topk_ids.shape[1]} law, weight {args.soft_weight}", file=sys.stderr)
    meta = data.meta
    if int(meta.get("n_embd", n_embd_t)) != n_embd_t:
        sys.exit(f"error: dataset n_embd {meta.get('n_embd')} != target n_embd {n_embd_t}: not read off this target")
    layers = [int(x) for x in meta["target_layers"].split(",")]
    mask_id = int(meta["mask_token_id"])
    n_feat_in = data.features.shape[1]
    if not data.train:
        sys.exit("error: no sequence has a target-written part longer than the block")

    e = args.hidden or n_embd_t
    heads = args.heads or max(1, e // 64)
    kv = args.kv_heads or (heads // 3 if heads % 3 == 0 else heads)
    hd = e // heads
    top_k = args.top_k
    while top_k and top_k * (top_k + 1) > e:
        top_k -= 1  # the lattice row (K ids + K*K scores) must fit n_embd
    gamma = args.gamma or (7.0 if args.block >= 16 else 4.0)

    # reduced draft vocabulary: the most frequent target-written tokens
    labels = data.answer_labels(data.train)
    counts = torch.bincount(labels, minlength=n_vocab)
    v = min(args.draft_vocab or n_vocab, n_vocab)
    d2t = torch.argsort(counts, descending=True, stable=True)[:v]
    t2d = torch.full((n_vocab,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(v)
    coverage = counts[d2t].sum().item() / max(1, counts.sum().item())

    config = {
        "architectures": ["DFlash2DraftModel" if top_k else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": e,
        "intermediate_size": args.ffn or max(64, int(round(e * 8 / 3 / 64)) * 64),
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_base,
        "hidden_act": "silu",
        "vocab_size": n_vocab,
        "max_position_embeddings": 32768,
        "draft_vocab_size": v,
        "dflash_config": {
            "target_layer_ids": [l - 1 for l in layers],  # reference ids = layer outputs
            "block_size": args.block,
            "mask_token_id": mask_id,
        },
    }
    if top_k:
        config["dflash_config"].update(conv_kernel_size=args.conv_kernel, conv_group_size=args.conv_group,
                                       selector_rank=args.rank, selector_top_k=top_k)

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    state_path = os.path.join(work, "state.pt")
    st = torch.load(state_path, weights_only=False, map_location="cpu") if os.path.exists(state_path) else None
    if st is not None and "d2t" in st:
        # a resumed run keeps its draft vocabulary (its head rows belong to those tokens)
        d2t = st["d2t"].cpu()
        t2d = torch.full((n_vocab,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(len(d2t))
        coverage = counts[d2t].sum().item() / max(1, counts.sum().item())
    model = Drafter(config, n_feat_in, n_vocab, v)
    if args.init_from_drafter and st is None:
        with torch.no_grad():
            d2t = init_from_drafter(model, args.init_from_drafter)
        if d2t is None or len(d2t) != v:
            sys.exit(f"error: {args.init_from_drafter} has no draft vocabulary of {v} tokens (d2t)")
        t2d = torch.full((n_vocab,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(len(d2t))
        coverage = counts[d2t].sum().item() / max(1, counts.sum().item())
    with torch.no_grad():
        if e == head.shape[1] and not (args.init_from_drafter and st is None):
            model.lm_head.weight.copy_(head[d2t])  # start from the target's own head rows
        if args.init_from_target and st is None:
            init_from_target(model, args.target, [int(x) for x in args.init_from_target.split(",")])
    model.to(device)
    tok_embd, t2d, d2t = tok_embd.to(device), t2d.to(device), d2t.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step = 0
    elapsed_before = 0.0  # training seconds of earlier runs of this state (resumed)
    rng = np.random.default_rng(args.seed)
    if st is not None:
        if st["config"] != config:
            sys.exit(f"error: {state_path} was trained with another configuration; remove it to start over")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])  # (moved to the parameters' device)
        step = st["step"]
        elapsed_before = st.get("elapsed", 0.0)
        rng = st["rng"]
        torch.set_rng_state(st["torch_rng"].cpu())
        print(f"resumed at step {step}", file=sys.stderr)

    n_params = sum(p.numel() for p in model.parameters())
    print(f"drafter: {args.layers} layers, width {e}, {heads}/{kv} heads, ffn {config['intermediate_size']}, "
          f"block {args.block}, top-k {top_k}, rank {args.rank if top_k else 0}, draft vocab {v} "
          f"({coverage:.1%} of target-written tokens), {n_params / 1e6:.1f} M parameters; "
          f"{len(data.train)} train / {len(data.val)} held-out sequences, {data.tokens.shape[0]} tokens",
          file=sys.stderr)

    def lr_at(s):
        # cosine to 10% over the run: its steps, or its time budget if that ends it first
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        p = (s - args.warmup) / max(1, args.steps - args.warmup)
        if args.minutes:
            p = max(p, (time.time() - t0 + elapsed_before) / (args.minutes * 60))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    def save_state():
        tmp = state_path + ".tmp"
        torch.save({"config": config, "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "rng": rng, "torch_rng": torch.get_rng_state(), "elapsed": time.time() - t0 + elapsed_before,
                    "d2t": d2t.cpu()}, tmp)
        os.replace(tmp, state_path)

    if args.init_from_drafter and st is None and data.val:
        # the starting point, as the drafter file gives it (q8_0 weights)
        model.eval()
        tau_g, tau_w = evaluate(model, data, data.val, args.block, tok_embd, mask_id, d2t, top_k, args.seed)
        walk = f", selector walk {tau_w:.3f}" if tau_w is not None else ""
        print(f"eval step 0: held-out tau (block {args.block}) argmax {tau_g:.3f}{walk}", file=sys.stderr, flush=True)
    t0 = time.time()
    run = {"loss": 0.0, "sel": 0.0, "acc1": 0.0, "in_topk": 0.0, "n": 0}
    first_loss = None
    model.train()
    by_len = sorted(data.train, key=lambda q: q[1] - q[0])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    while step < args.steps:
        over = deadline is not None and time.time() > deadline
        if over or (args.minutes and time.time() - t0 + elapsed_before > args.minutes * 60):
            print(f"time budget reached at step {step}", file=sys.stderr)
            break
        # block length: mostly the trained size, sometimes shorter (the engine drafts
        # shorter blocks when measured costs say so, and attention sees fewer masks then)
        block = int(rng.choice([args.block, max(2, args.block // 2), max(2, args.block // 4)], p=[0.6, 0.2, 0.2]))
        if args.seqs_per_step == 1:
            seqs = [data.train[rng.integers(len(data.train))]]
        else:  # neighbours in length pad together with little waste
            i = int(rng.integers(max(1, len(by_len) - args.seqs_per_step + 1)))
            seqs = by_len[i:i + args.seqs_per_step]
        # any anchor with a context before it: prompts and plain text teach the same
        # function as answers, wherever their labels are the target's own path
        his = [(e_ - s) - block + 1 for s, e_, _ in seqs]
        if min(his) <= 1:
            continue
        m = min(args.blocks_per_step, max(his) - 1)
        anchors = torch.from_numpy(np.stack([np.sort(rng.choice(np.arange(1, hi), size=m, replace=hi - 1 < m))
                                             for hi in his]))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with autocast:
            tok_loss, sel_loss, stats = block_losses(model, data, seqs, anchors, block, tok_embd, mask_id, t2d, d2t,
                                                     gamma, top_k, args.soft_weight)
        loss = tok_loss + sel_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        run["loss"] += tok_loss.item()
        run["sel"] += sel_loss.item()
        run["acc1"] += stats["acc1"]
        run["in_topk"] += stats.get("in_topk", 0.0)
        run["n"] += 1
        if first_loss is None:
            first_loss = tok_loss.item()
        if step % args.log_every == 0 or step == args.steps:
            n = run["n"]
            print(f"step {step}/{args.steps} loss {run['loss'] / n:.4f} selector {run['sel'] / n:.4f} "
                  f"acc@1 {run['acc1'] / n:.3f} in-top-k {run['in_topk'] / n:.3f} lr {lr_at(step):.2e} "
                  f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            run = {k: 0.0 for k in run} | {"n": 0}
        if step % args.save_every == 0:
            save_state()
        if data.val and (step % args.eval_every == 0 or step == args.steps):
            model.eval()
            tau_g, tau_w = evaluate(model, data, data.val, args.block, tok_embd, mask_id, d2t, top_k, args.seed)
            model.train()
            walk = f", selector walk {tau_w:.3f}" if tau_w is not None else ""
            print(f"eval step {step}: held-out tau (block {args.block}) argmax {tau_g:.3f}{walk}",
                  file=sys.stderr, flush=True)
    save_state()

    # the checkpoint, in z-lab's layout (+ lm_head and d2t for the reduced vocabulary)
    os.makedirs(args.out, exist_ok=True)
    sd = {k: t.detach().cpu().contiguous() for k, t in model.state_dict().items()}
    for side in ("predecessor", "successor"):  # z-lab stores the codebooks without `.weight`
        key = f"candidate_selector.{side}_codebook.weight"
        if key in sd:
            sd[key[: -len(".weight")]] = sd.pop(key)
    sd["d2t"] = d2t.cpu().clone()
    save_file(sd, os.path.join(args.out, "model.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump({"steps": step, "seed": args.seed, "first_loss": first_loss, "data": [os.path.basename(d) for d in args.data],
                   "target": os.path.basename(args.target), "train_seconds": round(time.time() - t0 + elapsed_before),
                   "draft_vocab_coverage": coverage}, f, indent=2)
    print(f"wrote {args.out} after {step} steps", file=sys.stderr)


if __name__ == "__main__":
    main()
