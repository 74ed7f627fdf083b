#!/usr/bin/env python3
"""Speculation under load (issue #49): aggregate tokens/s and per-request latency at several loads,
for llama-server, `dflash2 serve` with its defaults and `dflash2 serve` decoding plainly.

At each load L every server is started with `-np L` (all three at once, idle while the others are
measured), then, per prompt set and round, each server in turn (the order reversed every other round)
gets `--requests` /completion requests (ChatML prompt, greedy, `-n` tokens; each round the set's next
prompts) from L concurrent clients.
Prints per load: the median over rounds of aggregate tok/s, the median and p95 of request latency
(pooled over rounds), the ratios of the defaults against plain decoding and llama-server, how many of
the defaults' texts equal plain decoding's, and the defaults' drafted tokens per generated token
(the server's own /metrics counters). `--json FILE` keeps every figure.

    python3 tests/support/load_bench.py -m models/SmolLM2-135M-Instruct.Q4_1.gguf [--also before=OTHER_DFLASH2] \
        -d gguf-drafters/smollm2-135m-instruct.dflash2.gguf \
        --prompts chat=tests/support/chat-prompts.jsonl --prompts edit=models/edit-heldout.jsonl
"""
import argparse, json, os, queue, statistics, sys, threading, time, urllib.error, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import start, stop  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def post(url, body):
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=900))


def counters(url):
    """dflash2's drafted and generated token counters, from /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        for key in ("dflash2_draft_tokens_total", "dflash2_tokens_predicted_total"):
            if line.startswith(key + " "):
                out[key] = float(line.split()[1])
    return out


def cell(url, prompts, clients, n):
    """`prompts` ((index, text) pairs) sent by `clients` concurrent clients: (wall seconds,
    [(index, latency s, tokens, text)])."""
    todo = queue.Queue()
    for i, p in prompts:
        todo.put((i, p))
    done, lock = [], threading.Lock()

    def client():
        while True:
            try:
                i, p = todo.get_nowait()
            except queue.Empty:
                return
            body = {"prompt": "<|im_start|>user\n" + p + "<|im_end|>\n<|im_start|>assistant\n", "n_predict": n, "temperature": 0}
            t = time.time()
            try:
                r = post(url, body)
            except urllib.error.HTTPError as e:
                sys.exit(f"{url}: HTTP {e.code} for prompt {i}: {e.read().decode()[:300]}")
            with lock:
                done.append((i, time.time() - t, r["tokens_predicted"], r["content"]))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.time() - t0, sorted(done)


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-d", "--drafter", help="the defaults' drafter (without one they draft by look-up only)")
    ap.add_argument("--prompts", action="append", required=True, help="NAME=FILE.jsonl (repeatable)")
    ap.add_argument("--loads", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=16, help="requests per server, prompt set, load and round")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context per slot (`-c` is the slots' total, as in llama-server)")
    ap.add_argument("--dflash2", default=os.path.join(ROOT, "target/release/dflash2"))
    ap.add_argument("--llama-server", default=os.path.join(ROOT, "work/llama-server/build/bin/llama-server"))
    ap.add_argument("--port", type=int, default=8810)
    ap.add_argument("--also", action="append", default=[], help="NAME=BINARY: another dflash2 build's defaults, measured alongside")
    ap.add_argument("--json")
    a = ap.parse_args()
    sets = {}
    for spec in a.prompts:
        name, path = spec.split("=", 1)
        sets[name] = [json.loads(l)["prompt"] for l in open(path) if l.strip()]
    drafter = ["-d", a.drafter] if a.drafter else []
    results = []
    for load in [int(x) for x in a.loads.split(",")]:
        common = ["-m", a.model, "-t", "2", "-np", str(load)]
        cmds = {
            "llama-server": [a.llama_server, *common, "-c", str(a.ctx * load), "--port", str(a.port)],
            "defaults": [a.dflash2, "serve", *common, *drafter, "-c", str(a.ctx * load), "--port", str(a.port + 1)],
            "plain": [a.dflash2, "serve", *common, "--select", "none", "--no-lookup", "-c", str(a.ctx * load), "--port", str(a.port + 2)],
        }
        for k, spec in enumerate(a.also):  # other builds with their defaults, in the same rounds
            name, binary = spec.split("=", 1)
            cmds[name] = [binary, "serve", *common, *drafter, "-c", str(a.ctx * load), "--port", str(a.port + 3 + k)]
        urls = {s: f"http://127.0.0.1:{a.port + i}" for i, s in enumerate(cmds)}
        procs = []
        try:
            for s, cmd in cmds.items():
                procs.append(start(cmd, urls[s]))
            for s in cmds:  # warm-up: graphs, the cost model's first calibration
                cell(urls[s], [(-1, "Say hello.")], 1, 16)
            for name, prompts in sets.items():
                agg = {s: [] for s in cmds}
                lat = {s: [] for s in cmds}
                texts = {s: {} for s in cmds}
                before = counters(urls["defaults"])
                for r in range(a.rounds):
                    # Each round its own prompts (the set's next ones, wrapping): a server that keeps
                    # earlier prompts in RAM (llama-server's prompt cache) must not gain by it.
                    batch = [((r * a.requests + i) % len(prompts), prompts[(r * a.requests + i) % len(prompts)]) for i in range(a.requests)]
                    order = list(cmds) if r % 2 == 0 else list(reversed(cmds))
                    for s in order:
                        wall, done = cell(urls[s], batch, load, a.n)
                        agg[s].append(sum(d[2] for d in done) / wall)
                        lat[s] += [d[1] for d in done]
                        for i, _, _, text in done:
                            texts[s].setdefault(i, text)
                after = counters(urls["defaults"])
                generated = after["dflash2_tokens_predicted_total"] - before["dflash2_tokens_predicted_total"]
                drafted = after["dflash2_draft_tokens_total"] - before["dflash2_draft_tokens_total"]
                row = {
                    "load": load, "prompts": name, "requests": a.requests, "rounds": a.rounds,
                    "tok_s": {s: statistics.median(v) for s, v in agg.items()},
                    "tok_s_rounds": agg,
                    "latency_median_s": {s: statistics.median(v) for s, v in lat.items()},
                    "latency_p95_s": {s: p95(v) for s, v in lat.items()},
                    "equal_to_plain": sum(texts["defaults"][i] == texts["plain"][i] for i in texts["plain"]),
                    "equal_to_plain_also": {s: sum(texts[s][i] == texts["plain"][i] for i in texts["plain"]) for s in cmds if s not in ("llama-server", "plain", "defaults")},
                    "drafted_per_token": drafted / max(generated, 1),
                }
                results.append(row)
                t = row["tok_s"]
                others = "".join(f" {s} {t[s]:.1f} ({t['defaults'] / t[s]:.3f})" for s in cmds if s not in ("llama-server", "plain", "defaults"))
                print(f"{name} load {load}: tok/s llama-server {t['llama-server']:.1f} plain {t['plain']:.1f} defaults {t['defaults']:.1f}"
                      f" | defaults/plain {t['defaults'] / t['plain']:.3f} defaults/llama-server {t['defaults'] / t['llama-server']:.3f}"
                      f" | latency median/p95 s: " + " ".join(f"{s} {row['latency_median_s'][s]:.2f}/{row['latency_p95_s'][s]:.2f}" for s in cmds)
                      + f" | equal {row['equal_to_plain']}/{len(texts['plain'])} | drafted/token {row['drafted_per_token']:.2f}" + (f" | defaults against{others}" if others else ""), flush=True)
        finally:
            for p in procs:
                stop(p)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
