#!/usr/bin/env python3
"""The whole drafter recipe in one time-boxed run on a GPU machine that can fetch nothing.

In:  the target GGUF, tokenized prompts (tokenize_prompts.py), the `gguf` wheel on PYTHONPATH.
Out: (in --out, every file under 15 MB, as the device tool brings files back)
  run.log               progress, throughput and held-out tau
  corpus.npz            the answers generated here (token ids, per answer its prompt and how it was
                        decoded): the corpus a later run extends
  ckpt.json             the checkpoint's config.json and training.json
  ckpt.safetensors.NN   the checkpoint in float16, in parts: `cat` them, then `dflash2 convert`

Stages, each against a deadline so that what was reached comes back:
  1. answers: every prompt answered greedily by the PyTorch copy of the target (target_torch.py),
     then again with the first 1..--sample-max tokens sampled at T=0.8 and greedy after
     (varied text whose later tokens are still the target's own path), until the time share ends
  2. read: features, greedy labels and the top-8 law of every token (as `dflash2 dataset` reads them)
  3. train: train.py's drafter and losses, many sequences per step, bf16 autocast, the learning rate
     schedule fitted to the time left
"""
import argparse, gzip, hashlib, io, json, os, sys, tempfile, time, traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train as recipe  # noqa: E402
from target_torch import Target  # noqa: E402

PART = 15 << 20


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def write_parts(path, blob):
    """`blob` as path.00, path.01, ... of at most 15 MB each (or path alone when it fits)."""
    if len(blob) <= PART:
        open(path, "wb").write(blob)
        return [path]
    names = []
    for i in range(0, len(blob), PART):
        names.append(f"{path}.{i // PART:02d}")
        open(names[-1], "wb").write(blob[i:i + PART])
    return names


def held_out(prompt):
    """2% of prompts, by a hash of their text: the run's own held-out tau is measured on these."""
    return hashlib.sha256(prompt.encode()).digest()[1] % 50 == 0


def answer_all(target, rows, args, deadline):
    """Rounds of answers until the deadline: round 0 greedy, later rounds sampled first."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["ids"]))
    rng = np.random.default_rng(args.seed)
    out = []  # (prompt index, round, sampled first tokens, answer ids)
    for rnd in range(args.rounds):
        n_tok, t0 = 0, time.time()
        for b in range(0, len(order), args.gen_batch):
            if time.time() > deadline:
                log(f"answers: time share reached in round {rnd}")
                return out
            idx = order[b:b + args.gen_batch]
            if rnd > 0:
                idx = [i for i in idx if not held_out(rows[i]["prompt"])]
            if not idx:
                continue
            first = [0] * len(idx) if rnd == 0 else rng.integers(1, args.sample_max + 1, len(idx)).tolist()
            ans = target.generate([rows[i]["ids"] for i in idx], args.max_new, set(args.eog), first,
                                  temperature=0.8, seed=args.seed * 1000 + rnd * 100 + b)
            for i, f, a in zip(idx, first, ans):
                out.append((i, rnd, f, a))
                n_tok += len(a)
        log(f"answers: round {rnd} done, {n_tok} tokens, {n_tok / (time.time() - t0):.0f} tok/s")
    return out


def read_all(target, rows, answers, args, layers):
    """Flat training rows of every (prompt + answer), features in bfloat16 on the GPU."""
    seqs = [(rows[i]["ids"], a, held_out(rows[i]["prompt"]) and rnd == 0) for i, rnd, _, a in answers if len(a) >= 4]
    seqs.sort(key=lambda s: len(s[0]) + len(s[1]))
    total = sum(len(p) + len(a) for p, a, _ in seqs)
    if total > args.max_tokens:  # the GPU's memory: drop the longest beyond the cap
        keep, n = [], 0
        for s in seqs:
            if n + len(s[0]) + len(s[1]) > args.max_tokens:
                break
            keep.append(s)
            n += len(s[0]) + len(s[1])
        seqs, total = keep, n
    dev = target.device
    width = len(layers) * target.n_embd
    tokens = torch.empty(total, dtype=torch.long, device=dev)
    nxt = torch.empty(total, dtype=torch.long, device=dev)
    feats = torch.empty(total, width, dtype=torch.bfloat16, device=dev)
    topk_ids = torch.empty(total, 8, dtype=torch.long, device=dev)
    topk_lp = torch.empty(total, 8, dtype=torch.float16, device=dev)
    bounds, val = [], []
    at, i = 0, 0
    while i < len(seqs):
        # batches of about args.read_tokens tokens (sorted by length: little padding)
        j, longest = i, 0
        while j < len(seqs) and max(longest, len(seqs[j][0]) + len(seqs[j][1])) * (j - i + 1) <= args.read_tokens:
            longest = max(longest, len(seqs[j][0]) + len(seqs[j][1]))
            j += 1
        j = max(j, i + 1)
        batch = seqs[i:j]
        lens = torch.tensor([len(p) + len(a) for p, a, _ in batch], device=dev)
        ids = torch.zeros(len(batch), int(lens.max()), dtype=torch.long, device=dev)
        for r, (p, a, _) in enumerate(batch):
            ids[r, : len(p) + len(a)] = torch.tensor(p + a, device=dev)
        f, nx, ti, tl = target.read(ids, lens, layers, top_k=8)
        for r, (p, a, is_val) in enumerate(batch):
            n = len(p) + len(a)
            tokens[at:at + n], nxt[at:at + n] = ids[r, :n], nx[r, :n]
            feats[at:at + n] = f[r, :n].to(torch.bfloat16)
            topk_ids[at:at + n], topk_lp[at:at + n] = ti[r, :n], tl[r, :n].to(torch.float16)
            q = (at, at + n, at + len(p))
            bounds.append(q)
            if is_val:
                val.append(q)
            at += n
        i = j
    return tokens, nxt, feats, topk_ids, topk_lp, bounds, val


def main():
    global T0
    T0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True, help="tokenize_prompts.py output (JSONL.gz)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=9.0, help="the whole run, saving included")
    ap.add_argument("--answer-share", type=float, default=0.3, help="share of the time for answers")
    ap.add_argument("--rounds", type=int, default=4, help="answer rounds: one greedy, then sampled-first")
    ap.add_argument("--sample-max", type=int, default=24, help="sampled first tokens, at most")
    ap.add_argument("--max-new", type=int, default=320)
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--read-tokens", type=int, default=32768, help="tokens per read batch")
    ap.add_argument("--max-tokens", type=int, default=9_000_000, help="training tokens kept (GPU memory)")
    ap.add_argument("--eog", default="0,2", help="end-of-generation token ids")
    ap.add_argument("--layers", default="2,9,15,21,28", help="feature layers (inputs, as llama.cpp counts)")
    ap.add_argument("--mask-token", type=int, default=16)
    ap.add_argument("--limit", type=int, default=0, help="first N prompts only (a dry run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    args, rest = ap.parse_known_args()
    args.eog = [int(x) for x in args.eog.split(",")]
    layers = [int(x) for x in args.layers.split(",")]
    os.makedirs(args.out, exist_ok=True)
    end = T0 + args.minutes * 60
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    rows = [json.loads(l) for l in gzip.open(args.prompts, "rt")]
    if args.limit:
        rows = rows[: args.limit]
    target = Target(args.target, dev)
    log(f"target: {target.n_layer} layers, {target.n_embd} wide, vocab {target.n_vocab}; {len(rows)} prompts; "
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}")

    answers = []
    try:
        answers = answer_all(target, rows, args, T0 + (end - T0) * args.answer_share)
    except Exception:
        log("answers failed:\n" + traceback.format_exc())
    if answers:
        lens = np.array([len(a) for _, _, _, a in answers], dtype=np.int64)
        buf = io.BytesIO()
        np.savez_compressed(buf, prompt=np.array([i for i, _, _, _ in answers], dtype=np.int32),
                            round=np.array([r for _, r, _, _ in answers], dtype=np.int16),
                            sampled_first=np.array([f for _, _, f, _ in answers], dtype=np.int16),
                            offsets=np.concatenate([[0], np.cumsum(lens)]),
                            ids=np.array([t for _, _, _, a in answers for t in a], dtype=np.uint16))
        write_parts(os.path.join(args.out, "corpus.npz"), buf.getvalue())
        log(f"answers: {len(answers)}, {int(lens.sum())} tokens saved")
    if not answers:
        return

    try:
        t0 = time.time()
        tokens, nxt, feats, topk_ids, topk_lp, bounds, val = read_all(target, rows, answers, args, layers)
        log(f"read: {len(bounds)} sequences, {tokens.shape[0]} tokens in {time.time() - t0:.0f} s; "
            f"{len(val)} held out")
        tok_embd, head = target.embd.float().cpu(), target.head.float().cpu()
        rope_base = target.rope_base
        del target
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        ck = tempfile.mkdtemp(prefix="dflash2-ckpt-")
        targs = recipe.parser().parse_args(["--target", args.target, "--data", "gpu-campaign", "--out",
                                            ck, "--work", os.path.join(ck, "state"),
                                            "--device", args.device] + rest)
        meta = {"target_layers": args.layers, "n_embd": str(tok_embd.shape[1]), "mask_token_id": str(args.mask_token)}
        data = recipe.Data.from_arrays(meta, tokens, nxt, feats, topk_ids, topk_lp, bounds, 0.0, args.seed,
                                       targs.block + 2, val_seqs=val)
        # the cosine schedule ends with the time left (saving needs ~20 s)
        targs.minutes = max(0.5, (end - time.time() - 25) / 60)
        recipe.train(targs, data, tok_embd, head, rope_base, deadline=end - 25)
    except Exception:
        log("read/train failed:\n" + traceback.format_exc())
        return
    from safetensors.torch import load_file, save
    sd = load_file(os.path.join(ck, "model.safetensors"))
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
    write_parts(os.path.join(args.out, "ckpt.safetensors"), save(sd))
    meta = {"config": json.load(open(os.path.join(ck, "config.json"))),
            "training": json.load(open(os.path.join(ck, "training.json")))}
    json.dump(meta, open(os.path.join(args.out, "ckpt.json"), "w"), indent=1)
    log("done")


if __name__ == "__main__":
    main()
