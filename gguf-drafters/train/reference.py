#!/usr/bin/env python3
"""The drafter's candidate lattice for one block, computed in PyTorch from a checkpoint.

An independent computation of what llama.cpp's `dflash` graph must produce for the GGUF
that `dflash2 convert` makes of the same checkpoint (tests/drafter_training.rs compares
the two). Context: the dataset's target features of sequence --seq before --anchor; block:
[token at --anchor, MASK x (block-1)]. Writes JSON {"ids": [[K ids] per position],
"scores": [[[K x K]] per position]} in the engine's lattice layout: position t's
predecessors are the anchor (t = 0, one row repeated) or the candidates of position t-1;
for a DFlash 1 checkpoint "scores" holds each position's logits of its candidates.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import Data, Drafter, load_target  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--anchor", type=int, required=True, help="block start, relative to the sequence")
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--top-k", type=int, default=8, help="candidates per position for a DFlash 1 checkpoint")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    config = json.load(open(os.path.join(args.checkpoint, "config.json")))
    sd = load_file(os.path.join(args.checkpoint, "model.safetensors"))
    d2t = sd.pop("d2t")
    for side in ("predecessor", "successor"):
        key = f"candidate_selector.{side}_codebook"
        if key in sd:
            sd[key + ".weight"] = sd.pop(key)
    tok_embd, _, _, _ = load_target(args.target)
    data = Data(args.data, 0.0, 0, 0)
    s, e = data.offsets[args.seq], data.offsets[args.seq + 1]
    model = Drafter(config, data.features.shape[1], tok_embd.shape[0], d2t.shape[0])
    model.load_state_dict(sd)
    model.eval()
    mask_id = config["dflash_config"]["mask_token_id"]
    with torch.no_grad():
        h, logits = model(data.features[s:e][None], torch.tensor([[args.anchor]]), tok_embd, data.tokens[s:e][None], mask_id,
                          args.block)
        h, logits = h[0, 1:], logits[0, 1:]  # the block's draft positions
        anchor = data.tokens[s + args.anchor]
        ids, scores = [], []
        if model.dflash2:
            k = config["dflash_config"]["selector_top_k"]
            prev = anchor.view(1)
            for t in range(args.block - 1):
                cand_d = logits[t].topk(k).indices
                cand = d2t[cand_d]
                pair = model.selector_scores(h[t], cand, prev)  # [P, K]
                sc = logits[t][cand_d][None, :] + pair
                if t == 0:
                    sc = sc.expand(k, k)
                ids.append(cand.tolist())
                scores.append(sc.tolist())
                prev = cand
        else:
            for t in range(args.block - 1):
                cand_d = logits[t].topk(args.top_k).indices
                ids.append(d2t[cand_d].tolist())
                scores.append([logits[t][cand_d].tolist()] * args.top_k)
    json.dump({"ids": ids, "scores": scores}, open(args.out, "w"))


if __name__ == "__main__":
    main()
