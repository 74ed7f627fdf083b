#!/usr/bin/env python3
"""Aggregate generation speed of a running `dflash2 serve` at several concurrency levels.

Usage: bench_server.py URL PROMPTS.jsonl [--streams 1,2,4,8] [--n 64] [--rounds 3]
Each round sends `streams` concurrent streaming /completion requests (greedy) and measures
generated tokens / wall time; the median over rounds is printed per level.
Only loopback URLs are accepted.
"""
import argparse, json, statistics, threading, time, urllib.request
from urllib.parse import urlparse

def complete(url, prompt, n):
    body = json.dumps({"prompt": prompt, "n_predict": n, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev.get("stop"):
                    tokens = ev.get("tokens_predicted", tokens)
    return tokens

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url"); ap.add_argument("prompts")
    ap.add_argument("--streams", default="1,2,4,8"); ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    assert urlparse(a.url).hostname in ("127.0.0.1", "localhost", "::1"), "loopback only"
    prompts = [json.loads(l)["prompt"] for l in open(a.prompts) if l.strip()]
    out = {}
    for s in [int(x) for x in a.streams.split(",")]:
        rates = []
        for r in range(a.rounds):
            results = [0] * s
            def work(i):
                results[i] = complete(a.url, prompts[(r * s + i) % len(prompts)], a.n)
            threads = [threading.Thread(target=work, args=(i,)) for i in range(s)]
            t0 = time.time()
            for t in threads: t.start()
            for t in threads: t.join()
            rates.append(sum(results) / (time.time() - t0))
        out[s] = statistics.median(rates)
        print(f"streams {s}: {out[s]:.1f} tok/s aggregate (median of {a.rounds})", flush=True)
    print(json.dumps(out))

if __name__ == "__main__":
    main()
