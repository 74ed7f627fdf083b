"""A/B of two dflash2 binaries, pair by pair (usage: ab_binaries.py OLD NEW PROMPTS ROUNDS, run from the
repository root with the SmolLM2 models fetched): for every prompt and mode, `generate --json` with one
binary then the other (order alternating), each under an exclusive lock; the median over pairs of
new/old tokens/s, and whether tokens and tau agree."""
import json, os, subprocess, sys, statistics
# each run holds this lock exclusively, so builds or tests that hold it shared never overlap a timing
LOCK = os.environ.get("DFLASH2_BENCH_LOCK", "/tmp/dflash2-bench.lock")
old, new, limit, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = [json.loads(l)["prompt"] for l in open("models/humaneval-heldout.jsonl") if l.strip()][:limit]
base = ["-t", "2", "-m", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "-d", "gguf-drafters/smollm2-135m-instruct.dflash2.gguf", "-n", "96", "--json"]
modes = {"plain": ["--select", "none", "--no-lookup"], "defaults (auto, drafter + look-up)": [],
         "greedy block 8": ["--select", "greedy", "--block", "8"], "tree block 8": ["--select", "tree", "--block", "8"]}
res = {m: [] for m in modes}
k = 0
for r in range(rounds):
    for p in prompts:
        for m, a in modes.items():
            order = [("old", old), ("new", new)] if k % 2 == 0 else [("new", new), ("old", old)]
            k += 1
            out = {}
            for name, b in order:
                q = subprocess.run(["flock", "-x", LOCK, b, "generate", *base, *a, "-p", p], capture_output=True, text=True, check=True)
                out[name] = json.loads(q.stdout)
            res[m].append((out["new"]["tokens_per_second"] / out["old"]["tokens_per_second"], out["new"]["tokens"] == out["old"]["tokens"], out["new"]["tau"], out["old"]["tau"]))
for m, v in res.items():
    rs = sorted(x[0] for x in v)
    print(f"{m}: pairs {len(v)}, new/old tok/s median {statistics.median(rs):.4f} (quartiles {rs[len(rs)//4]:.3f}-{rs[3*len(rs)//4]:.3f}), tokens equal {sum(x[1] for x in v)}/{len(v)}, tau new {statistics.median(x[2] for x in v):.3f} old {statistics.median(x[3] for x in v):.3f}", flush=True)
