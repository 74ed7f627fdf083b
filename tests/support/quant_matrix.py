#!/usr/bin/env python3
"""The quantization matrix (issue #43, BENCHMARKS.md): for each GGUF target, what its file holds
(tensor types and bytes), what the load-time probe finds (verify batches of 2-33 rows in single
steps, bit-exact or not, with weight repacking on and off, and the layout it chooses), and plain
decoding side by side with llama-server (its defaults; built by tests/support/build-llama-server.sh
from the llama.cpp dflash2 bundles): `dflash2 serve --select none --no-lookup` against it on the same
/completion requests, alternated (tests/support/side_by_side.py), medians of per-request ratios of
generation and prompt tok/s, and whether every text was the same.

    python3 tests/support/quant_matrix.py --llama-server PATH [--dflash2 target/release/dflash2]
        [--prompts models/humaneval-heldout.jsonl] [--limit 4] [-n 64] [--runs 3] MODEL.gguf ...

Prints one markdown row per model as it goes and, with --json FILE, writes every figure there.
"""
import argparse, json, os, statistics, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import compare, ratios, start, stop  # noqa: E402

BATCHES = [2, 4, 8, 16, 33]


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--dflash2", default="target/release/dflash2")
    ap.add_argument("--prompts", default="models/humaneval-heldout.jsonl")
    ap.add_argument("--limit", type=int, default=4, help="first K prompts (each sent twice to each server)")
    ap.add_argument("-n", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--runs", type=int, default=3, help="probes per repack setting (their median times)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18100)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("models", nargs="+")
    a = ap.parse_args()
    prompts = [json.loads(l)["prompt"] for l in open(a.prompts) if l.strip()][:a.limit]
    rows = []
    print("| file | tensor types (MB) | layout | bit-exact | verify 2/4/8/16/33 rows (steps) | llama-server plain tok/s (prompt) | dflash2 plain / llama-server (prompt) | same texts |")
    print("|---|---|---|---|---|---|---|---|")
    for model in a.models:
        info = run_json([a.dflash2, "inspect", model, "--json"])
        types = [(t["type_name"], t["bytes"] / 1e6) for t in info.get("tensor_types", []) if t["type_name"] != "F32"]  # older builds: none
        check = run_json([a.dflash2, "inspect", model, "--check", "--json", "-t", str(a.threads), "--runs", str(a.runs),
                          "--batches", ",".join(map(str, BATCHES))])
        on, off = check["probes"]
        chosen = on if all(c["identical"] for c in on["checks"]) else off
        curve = [c["ms"] / chosen["single_ms"] for c in chosen["checks"]]
        exact = all(c["identical"] for c in chosen["checks"])

        urls = {"llama-server": f"http://127.0.0.1:{a.port}", "dflash2": f"http://127.0.0.1:{a.port + 1}"}
        servers = [start([a.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(a.port), "-t", str(a.threads)], urls["llama-server"]),
                   start([a.dflash2, "serve", "-m", model, "--host", "127.0.0.1", "--port", str(a.port + 1), "-t", str(a.threads),
                          "--select", "none", "--no-lookup"], urls["dflash2"])]
        try:
            speed, prefill, texts = compare(urls, prompts, a.n)
        finally:
            for s in servers:
                stop(s)
        row = {
            "file": os.path.basename(model), "tensor_types_mb": types, "repack": chosen["repack"], "bit_exact": exact,
            "single_ms": chosen["single_ms"], "verify_steps": dict(zip(BATCHES, curve)),
            "llama_server_tok_s": statistics.median(speed["llama-server"]), "llama_server_prompt_tok_s": statistics.median(prefill["llama-server"]),
            "dflash2_tok_s": statistics.median(speed["dflash2"]), "dflash2_prompt_tok_s": statistics.median(prefill["dflash2"]),
            "plain_ratio": ratios(speed["dflash2"], speed["llama-server"]), "prompt_ratio": ratios(prefill["dflash2"], prefill["llama-server"]),
            "same_texts": sum(x == y for x, y in zip(texts["dflash2"], texts["llama-server"])), "requests": len(texts["dflash2"]),
        }
        rows.append(row)
        print(f"| {row['file']} | {', '.join(f'{n} {mb:.0f}' for n, mb in types)} | {'repacked' if row['repack'] else 'unrepacked'} | "
              f"{'yes' if exact else 'NO'} | {' / '.join(f'{x:.2f}' for x in curve)} | {row['llama_server_tok_s']:.1f} ({row['llama_server_prompt_tok_s']:.0f}) | "
              f"{row['plain_ratio']:.2f}x ({row['prompt_ratio']:.2f}x) | {row['same_texts']}/{row['requests']} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
