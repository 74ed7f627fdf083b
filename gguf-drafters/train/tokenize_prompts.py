#!/usr/bin/env python3
"""Render and tokenize training prompts exactly as the engine does, for a machine without llama.cpp.

Each prompt becomes a one-turn chat, rendered with the target's own Jinja template and tokenized by
llama.cpp, through a running `dflash2 serve -m TARGET` (its /apply-template and /tokenize: the
same code every chat path uses). The output feeds `gpu_campaign.py`, which decodes on a GPU with
the PyTorch copy of the target and has no tokenizer of its own.

    dflash2 serve -m models/SmolLM2-135M-Instruct.Q4_1.gguf --port 18099 &
    tokenize_prompts.py --prompts prompts.jsonl --server http://127.0.0.1:18099 --out prompts-ids.jsonl.gz
"""
import argparse, gzip, json, sys, urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="JSONL of {source, prompt} (make_prompts.py)")
    ap.add_argument("--server", required=True, help="URL of `dflash2 serve -m TARGET`")
    ap.add_argument("--out", required=True, help="JSONL.gz of {source, prompt, ids}")
    ap.add_argument("--max-tokens", type=int, default=512, help="skip prompts longer than this")
    args = ap.parse_args()
    props = json.loads(urllib.request.urlopen(args.server + "/props", timeout=60).read())
    kept = skipped = 0
    with open(args.prompts) as src, gzip.open(args.out, "wt") as out:
        for line in src:
            row = json.loads(line)
            text = post(args.server + "/apply-template", {"messages": [{"role": "user", "content": row["prompt"]}]})["prompt"]
            ids = post(args.server + "/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
            if len(ids) > args.max_tokens:
                skipped += 1
                continue
            out.write(json.dumps({"source": row.get("source", ""), "prompt": row["prompt"], "ids": ids}) + "\n")
            kept += 1
    print(f"{kept} prompts tokenized with {props.get('model_path')}'s template ({skipped} over {args.max_tokens} tokens "
          f"skipped) -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
