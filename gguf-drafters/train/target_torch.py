"""A llama-architecture GGUF target in PyTorch, for machines where llama.cpp is not built (a GPU
machine that cannot fetch anything): the quantized weights dequantized as they are stored, so it
computes the served model (up to the rounding of llama.cpp's kernels, which quantize activations:
`check` measures how often the two disagree).

What the drafter recipe needs from a target, batched on one device:
  generate()  answers for many prompts at once (left-padded, KV cache): greedy, or sampled for
              its first tokens and greedy after, which keeps most labels on the target's path
              while varying the text
  read()      what `dflash2 dataset` reads off the target: per token the inputs of the feature
              layers, the greedy next token and the top-K log-probabilities

The GGUF layout is llama.cpp's: Q/K rows permuted for rope "normal" mode (adjacent pairs rotate),
a tied output head when there is no `output.weight`.
"""
import numpy as np
import torch
import torch.nn.functional as F


class Target:
    def __init__(self, path, device, dtype=torch.float32):
        import gguf

        r = gguf.GGUFReader(path)
        arch = r.fields["general.architecture"].contents()
        if arch != "llama":
            raise SystemExit(f"error: {path}: architecture {arch}; target_torch.py computes llama targets only")

        def field(key, default=None):
            f = r.fields.get(f"{arch}.{key}")
            return f.contents() if f is not None else default

        self.n_layer = int(field("block_count"))
        self.n_embd = int(field("embedding_length"))
        self.n_head = int(field("attention.head_count"))
        self.n_kv = int(field("attention.head_count_kv", self.n_head))
        self.hd = self.n_embd // self.n_head
        self.eps = float(field("attention.layer_norm_rms_epsilon"))
        self.rope_base = float(field("rope.freq_base", 10000.0))
        self.device, self.dtype = device, dtype
        tensors = {t.name: t for t in r.tensors}

        def w(name):
            t = tensors[name]
            a = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
            return torch.from_numpy(a).to(device=device, dtype=dtype)

        self.embd = w("token_embd.weight")
        self.head = w("output.weight") if "output.weight" in tensors else self.embd
        self.out_norm = w("output_norm.weight")
        self.layers = []
        for il in range(self.n_layer):
            p = f"blk.{il}."
            self.layers.append({k: w(p + k + ".weight") for k in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
        self.n_vocab = self.embd.shape[0]
        inv = self.rope_base ** (-torch.arange(0, self.hd, 2, dtype=torch.float32, device=device) / self.hd)
        self.inv_freq = inv

    # ------------------------------------------------------------------ pieces

    def norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, pos):
        """x [B, L, heads, hd], pos [B, L]: llama.cpp's normal mode (pairs 2i, 2i+1 rotate)."""
        ang = pos.to(torch.float32)[..., None] * self.inv_freq  # [B, L, hd/2]
        cos, sin = ang.cos()[:, :, None, :].to(x.dtype), ang.sin()[:, :, None, :].to(x.dtype)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)

    def attend(self, q, k, v, mask):
        """q [B, L, H, hd]; k, v [B, S, KV, hd]; mask [B, L, S] (True = attend). Query heads are
        grouped under their key/value head (head h reads kv head h // (H/KV), as llama.cpp does),
        so grouped-query attention needs no copy of K/V."""
        b, l, h, hd = q.shape
        g = h // self.n_kv
        q = q.view(b, l, self.n_kv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, self.n_kv, g * l, hd)
        m = mask[:, None, None].expand(b, 1, g, l, mask.shape[-1]).reshape(b, 1, g * l, mask.shape[-1])
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, scale=hd ** -0.5)
        return o.view(b, self.n_kv, g, l, hd).permute(0, 3, 1, 2, 4).reshape(b, l, h * hd)

    def layer(self, il, x, pos, mask, cache=None, at=None):
        """One block on x [B, L, E]. With a cache ((K, V) [B, S, KV, hd] each), this step's K/V
        are written at columns at..at+L and attention reads the whole cache."""
        p = self.layers[il]
        b, l, _ = x.shape
        h = self.norm(x, p["attn_norm"])
        q = self.rope((h @ p["attn_q"].T).view(b, l, self.n_head, self.hd), pos)
        k = self.rope((h @ p["attn_k"].T).view(b, l, self.n_kv, self.hd), pos)
        v = (h @ p["attn_v"].T).view(b, l, self.n_kv, self.hd)
        if cache is not None:
            cache[0][:, at:at + l] = k
            cache[1][:, at:at + l] = v
            k, v = cache
        x = x + self.attend(q, k, v, mask) @ p["attn_output"].T
        h = self.norm(x, p["ffn_norm"])
        return x + (F.silu(h @ p["ffn_gate"].T) * (h @ p["ffn_up"].T)) @ p["ffn_down"].T

    def logits(self, x):
        return self.norm(x, self.out_norm) @ self.head.T

    # ------------------------------------------------------------------ whole sequences

    @torch.no_grad()
    def read(self, ids, lens, feature_layers, top_k=8):
        """Right-padded ids [B, L] (lens [B] valid tokens): features [B, L, n*E] (the inputs of
        `feature_layers`, in that order), greedy next [B, L], top-K ids and log-probabilities."""
        b, l = ids.shape
        pos = torch.arange(l, device=ids.device).expand(b, l)
        valid = pos < lens[:, None]
        mask = (pos[:, None, :] <= pos[:, :, None]) & valid[:, None, :]
        x = self.embd[ids]
        feats = {}
        for il in range(self.n_layer):
            if il in feature_layers:
                feats[il] = x
            x = self.layer(il, x, pos, mask)
        lg = self.logits(x).float()
        lp = torch.log_softmax(lg, -1)
        top = lp.topk(top_k, dim=-1) if top_k else None
        f = torch.cat([feats[il] for il in feature_layers], -1) if feature_layers else None
        return f, lg.argmax(-1), (top.indices if top else None), (top.values if top else None)

    @torch.no_grad()
    def generate(self, prompts, max_new, eog, sample_first=None, temperature=0.8, seed=0):
        """Answers (lists of token ids, EOG excluded) to `prompts` (lists of ids), decoded together.
        sample_first[i]: how many first tokens of answer i are sampled at `temperature` (0: greedy
        throughout); every later token is the target's argmax."""
        dev = self.device
        b = len(prompts)
        lp = max(len(p) for p in prompts)
        total = lp + max_new
        ids = torch.zeros(b, lp, dtype=torch.long, device=dev)
        pad = torch.tensor([lp - len(p) for p in prompts], device=dev)
        for i, p in enumerate(prompts):
            ids[i, lp - len(p):] = torch.tensor(p, device=dev)
        col = torch.arange(total, device=dev)
        key_ok = col[None, :] >= pad[:, None]  # [B, total]: left pads never attended
        caches = [(torch.zeros(b, total, self.n_kv, self.hd, device=dev, dtype=self.dtype),
                   torch.zeros(b, total, self.n_kv, self.hd, device=dev, dtype=self.dtype)) for _ in range(self.n_layer)]
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        sample_first = torch.as_tensor(sample_first if sample_first is not None else [0] * b, device=dev)
        eog = torch.tensor(sorted(eog), device=dev)
        out = torch.zeros(b, max_new, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        n_out = torch.full((b,), max_new, dtype=torch.long, device=dev)
        x_ids, at, width = ids, 0, lp
        for step in range(max_new):
            pos = (col[at:at + width][None, :] - pad[:, None]).clamp(min=0)
            mask = key_ok[:, None, :] & (col[None, None, :] <= col[at:at + width][None, :, None])
            x = self.embd[x_ids]
            for il in range(self.n_layer):
                x = self.layer(il, x, pos, mask, caches[il], at)
            lg = self.logits(x[:, -1]).float()
            nxt = lg.argmax(-1)
            sampled = step < sample_first
            if sampled.any():
                drawn = torch.multinomial(torch.softmax(lg / temperature, -1), 1, generator=gen)[:, 0]
                nxt = torch.where(sampled, drawn, nxt)
            ended = torch.isin(nxt, eog) & ~done
            n_out = torch.where(ended, torch.full_like(n_out, step), n_out)
            done |= ended
            out[:, step] = nxt
            if bool(done.all()):
                break
            at, width = at + width, 1
            x_ids = nxt[:, None]
        out, n_out = out.cpu(), n_out.cpu()
        return [out[i, : n_out[i]].tolist() for i in range(b)]


def check(target_path, data_path, max_seqs, min_agree, max_err):
    """How closely this copy computes the target, against a `dflash2 dataset` file read off it by
    llama.cpp: greedy next tokens, features; and whether cached batched decoding (left padding)
    gives the tokens a full read of the same text does. Exits 1 below the bounds."""
    import json
    import sys
    from safetensors.numpy import load_file

    d = load_file(data_path)
    with open(data_path, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little"))).get("__metadata__", {})
    layers = [int(x) for x in meta["target_layers"].split(",")]
    t = Target(target_path, "cpu")
    off = d["offsets"]
    agree = total = 0
    err_num = err_den = 0.0
    prompts = []
    for i in range(min(max_seqs, len(off) - 1)):
        s, e = int(off[i]), int(off[i + 1])
        ids = torch.from_numpy(d["tokens"][s:e].astype(np.int64))[None]
        f, nx, _, _ = t.read(ids, torch.tensor([e - s]), layers, top_k=0)
        agree += int((nx[0] == torch.from_numpy(d["next"][s:e].astype(np.int64))).sum())
        total += e - s
        ref = torch.from_numpy(d["features"][s:e])
        err_num += float((f[0] - ref).pow(2).sum())
        err_den += float(ref.pow(2).sum())
        a = int(d["answer_start"][i]) - s
        if a > 1 and len(prompts) < 4:
            prompts.append(d["tokens"][s:s + a].astype(np.int64).tolist())
    # cached, left-padded batch decoding against a full read of each answer
    answers = t.generate(prompts, 12, eog=set())
    same = n = 0
    for p, a in zip(prompts, answers):
        ids = torch.tensor(p + a)[None]
        _, nx, _, _ = t.read(ids, torch.tensor([ids.shape[1]]), [], top_k=0)
        same += sum(int(nx[0, len(p) - 1 + j]) == a[j] for j in range(len(a)))
        n += len(a)
    rate, err, cached = agree / max(total, 1), (err_num / max(err_den, 1e-30)) ** 0.5, same / max(n, 1)
    print(f"greedy next agrees with llama.cpp on {rate:.4f} of {total} tokens; feature relative error {err:.4f}; "
          f"cached decoding agrees with a full read on {cached:.4f} of {n} tokens", file=sys.stderr)
    ok = rate >= min_agree and err <= max_err and cached >= 0.95
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Check this PyTorch copy of a GGUF target against llama.cpp")
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, help="a `dflash2 dataset` file read off the same target")
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--min-agree", type=float, default=0.97)
    ap.add_argument("--max-err", type=float, default=0.03)
    a = ap.parse_args()
    check(a.target, a.data, a.max_seqs, a.min_agree, a.max_err)
