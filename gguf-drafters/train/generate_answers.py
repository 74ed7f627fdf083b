#!/usr/bin/env python3
"""Answer every training prompt with the target itself (greedy), through `dflash2 generate`.

The drafter must learn what the TARGET says, so its answers (not human ones) are the
training text. Writes JSONL rows {"source", "prompt", "answer"}; resumable: prompts
already answered in --out are skipped.
"""
import argparse, json, os, subprocess, sys, time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dflash2", default="target/release/dflash2", help="the dflash2 binary")
    ap.add_argument("--model", required=True, help="target GGUF")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    args = ap.parse_args()

    prompts = [json.loads(l) for l in open(args.prompts)]
    done = set()
    if os.path.exists(args.out):
        done = {json.loads(l)["prompt"] for l in open(args.out)}
    todo = [p for p in prompts if p["prompt"] not in done]
    print(f"{len(todo)} of {len(prompts)} prompts to answer", file=sys.stderr)
    start = time.time()
    with open(args.out, "a") as out:
        for i, row in enumerate(todo):
            r = subprocess.run(
                [args.dflash2, "generate", "-m", args.model, "--select", "none", "--chat",
                 "-n", str(args.max_tokens), "-p", row["prompt"]],
                capture_output=True, text=True, check=True)
            out.write(json.dumps({**row, "answer": r.stdout.rstrip("\n")}) + "\n")
            out.flush()
            if (i + 1) % 20 == 0:
                print(f"{i + 1}/{len(todo)} answered in {time.time() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
