#!/usr/bin/env python3
"""Plain decoding side by side (issue #18, item 3): the same /completion requests (SmolLM2's chat
template, N tokens (default 128), T = 0, no prompt cache) to each running server, alternated prompt by
prompt, twice (the second pass in reverse order). Prints each server's median predicted and prompt
tok/s and, against the first server (and for each `--pair A/B`, of A against B), the medians of
per-request ratios and how many texts were identical.

    python3 tests/support/side_by_side.py [-n N] [--limit K] [--pair A/B ...] PROMPTS.jsonl NAME=URL NAME=URL ...
"""
import argparse, json, urllib.request, statistics
ap = argparse.ArgumentParser()
ap.add_argument("-n", type=int, default=128, help="tokens generated per request")
ap.add_argument("--limit", type=int, default=16, help="first K prompts")
ap.add_argument("--pair", action="append", default=[], help="A/B: also the ratios of server A against server B")
ap.add_argument("prompts")
ap.add_argument("servers", nargs="+", help="NAME=URL")
args = ap.parse_args()
servers = dict(a.split("=", 1) for a in args.servers)
prompts = [json.loads(l)["prompt"] for l in open(args.prompts)][:args.limit]
def post(url, body):
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))
speed = {n: [] for n in servers}
prefill = {n: [] for n in servers}
texts = {n: [] for n in servers}
for rep in range(2):
    for p in prompts:
        body = {"prompt": "<|im_start|>user\n" + p + "<|im_end|>\n<|im_start|>assistant\n", "n_predict": args.n, "temperature": 0, "cache_prompt": False}
        for n, u in (servers.items() if rep == 0 else reversed(servers.items())):
            r = post(u, body)
            speed[n].append(r["timings"]["predicted_per_second"])
            prefill[n].append(r["timings"]["prompt_per_second"])
            texts[n].append(r["content"])
names = list(servers)
for n in names:
    print(f"{n}: median {statistics.median(speed[n]):.1f} tok/s over {len(speed[n])} requests (prompt {statistics.median(prefill[n]):.0f} tok/s)")
pairs = [(n, names[0]) for n in names[1:]] + [tuple(p.split("/", 1)) for p in args.pair]
for n, base in pairs:
    ratios = [a / b for a, b in zip(speed[n], speed[base])]
    same = sum(x == y for x, y in zip(texts[n], texts[base]))
    pratios = [a / b for a, b in zip(prefill[n], prefill[base])]
    print(f"{n} / {base}: median ratio {statistics.median(ratios):.3f} (prompt {statistics.median(pratios):.3f}); identical texts {same}/{len(ratios)}")
