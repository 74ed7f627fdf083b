#!/usr/bin/env python3
"""Plain decoding side by side (issue #18, item 3): the same /completion requests (the ChatML template
of SmolLM2 and Qwen2.5, N tokens (default 128), T = 0, no prompt cache) to each running server,
alternated prompt by prompt, twice (the second pass in reverse order). Prints each server's median
predicted and prompt tok/s and, against the first server (and for each `--pair A/B`, of A against B),
the medians of per-request ratios and how many texts were identical.

    python3 tests/support/side_by_side.py [-n N] [--limit K] [--pair A/B ...] PROMPTS.jsonl NAME=URL NAME=URL ...

With `--launch 'NAME=PORT:COMMAND'` (repeatable) it starts each server itself (COMMAND must listen on
127.0.0.1:PORT), waits for its /health, and stops it afterwards. `compare()`, `start()` and `stop()`
serve other scripts too (tests/support/quant_matrix.py).
"""
import argparse, json, os, shlex, signal, statistics, subprocess, sys, time, urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))


def compare(servers, prompts, n):
    """Alternated requests to every server in `servers` (name -> URL): per server the lists of
    predicted tok/s, prompt tok/s and texts, request by request in the same order."""
    speed = {s: [] for s in servers}
    prefill = {s: [] for s in servers}
    texts = {s: [] for s in servers}
    for rep in range(2):
        for p in prompts:
            body = {"prompt": "<|im_start|>user\n" + p + "<|im_end|>\n<|im_start|>assistant\n", "n_predict": n, "temperature": 0, "cache_prompt": False}
            for s, u in (servers.items() if rep == 0 else reversed(servers.items())):
                r = post(u, body)
                speed[s].append(r["timings"]["predicted_per_second"])
                prefill[s].append(r["timings"]["prompt_per_second"])
                texts[s].append(r["content"])
    return speed, prefill, texts


def start(cmd, url):
    """Start a server (`cmd`, a list) and wait until `url`/health answers 200."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(1200):
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc
        except OSError:
            pass
        if proc.poll() is not None:
            sys.exit(f"server exited ({proc.returncode}): {' '.join(cmd)}")
        time.sleep(0.5)
    stop(proc)
    sys.exit(f"server did not come up: {' '.join(cmd)}")


def stop(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def ratios(a, b):
    """The median of per-request ratios a / b."""
    return statistics.median(x / y for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--limit", type=int, default=16, help="first K prompts")
    ap.add_argument("--pair", action="append", default=[], help="A/B: also the ratios of server A against server B")
    ap.add_argument("--launch", action="append", default=[], help="NAME=PORT:COMMAND: start this server for the run")
    ap.add_argument("prompts")
    ap.add_argument("servers", nargs="*", help="NAME=URL")
    args = ap.parse_args()
    servers = dict(a.split("=", 1) for a in args.servers)
    launched = []
    try:
        for spec in args.launch:
            name, rest = spec.split("=", 1)
            port, cmd = rest.split(":", 1)
            servers[name] = f"http://127.0.0.1:{port}"
            launched.append(start(shlex.split(cmd), servers[name]))
        prompts = [json.loads(l)["prompt"] for l in open(args.prompts)][:args.limit]
        speed, prefill, texts = compare(servers, prompts, args.n)
    finally:
        for proc in launched:
            stop(proc)
    names = list(servers)
    for s in names:
        print(f"{s}: median {statistics.median(speed[s]):.1f} tok/s over {len(speed[s])} requests (prompt {statistics.median(prefill[s]):.0f} tok/s)")
    pairs = [(s, names[0]) for s in names[1:]] + [tuple(p.split("/", 1)) for p in args.pair]
    for s, base in pairs:
        same = sum(x == y for x, y in zip(texts[s], texts[base]))
        print(f"{s} / {base}: median ratio {ratios(speed[s], speed[base]):.3f} (prompt {ratios(prefill[s], prefill[base]):.3f}); "
              f"identical texts {same}/{len(texts[s])}")


if __name__ == "__main__":
    main()
