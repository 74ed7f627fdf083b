#!/usr/bin/env python3
"""Pack target-written answers (`dflash2 answer` output) into the committed corpus.

The corpus is what later sessions extend instead of regenerating: prompts, the target's answer
text and token ids, compressed, with the target's sha256 and how the answers were made. Features
are not committed: `dflash2 dataset` reads them off the target again on each machine, at prefill
speed.

    pack_corpus.py --answers work/smollm2/answers-v2.jsonl --target models/T.gguf \
        --out gguf-drafters/train/corpus/smollm2-135m-instruct --command "dflash2 answer ..."

Writes OUT/answers.jsonl.gz (rows sorted by prompt, then sample, so reruns diff cleanly) and
OUT/MANIFEST.json. Rows already in an existing OUT/answers.jsonl.gz are kept (merged by
(prompt, sample)), so the corpus only grows.
"""
import argparse, datetime, gzip, hashlib, json, os, subprocess, sys


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_rows(path, opener):
    if not os.path.exists(path):
        return []
    with opener(path, "rt") as f:
        return [json.loads(l) for l in f if l.strip()]


def history(manifest):
    """The packs recorded so far (a manifest from before the history was kept: one entry)."""
    made = manifest.get("made_with")
    if made is None:
        return []
    if isinstance(made, list):
        return made
    return [{"command": made, "added": manifest.get("answers"), "dflash2_commit": manifest.get("dflash2_commit"),
             "date": manifest.get("updated")}]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", required=True, help="JSONL written by `dflash2 answer`")
    ap.add_argument("--target", required=True, help="the target GGUF that wrote them")
    ap.add_argument("--out", required=True, help="corpus directory")
    ap.add_argument("--command", required=True, help="the command that made the answers (recorded)")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    corpus = os.path.join(args.out, "answers.jsonl.gz")
    manifest_path = os.path.join(args.out, "MANIFEST.json")
    target_sha = sha256(args.target)
    old = {}
    if os.path.exists(manifest_path):
        old = json.load(open(manifest_path))
        if old["target_sha256"] != target_sha:
            sys.exit(f"{args.target} is not the target of the corpus in {args.out} ({old['target_sha256']})")
    before = {(r["prompt"], r.get("sample", 0)) for r in read_rows(corpus, gzip.open)}

    rows = {}
    for r in read_rows(corpus, gzip.open) + read_rows(args.answers, open):
        keep = {k: r[k] for k in ("source", "prompt", "sample", "temperature", "seed", "answer", "answer_tokens") if k in r}
        rows[(r["prompt"], r.get("sample", 0))] = keep
    ordered = [rows[k] for k in sorted(rows)]
    with gzip.open(corpus, "wt", compresslevel=9) as f:
        for r in ordered:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    by_source = {}
    for r in ordered:
        by_source[r.get("source", "?")] = by_source.get(r.get("source", "?"), 0) + 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    manifest = {
        "target": os.path.basename(args.target),
        "target_sha256": target_sha,
        "answers": len(ordered),
        "answer_tokens": sum(len(r["answer_tokens"]) for r in ordered),
        "by_source": by_source,
        "sampled_answers": sum(1 for r in ordered if r.get("sample", 0) > 0),
        # every pack that added rows, oldest first: how each part of the corpus was made
        "made_with": history(old) + [{"command": args.command, "added": len(set(rows) - before),
                                      "dflash2_commit": commit, "date": datetime.date.today().isoformat()}],
        "held_apart": "HumanEval 124..163 and one ShareGPT turn in 20 (make_prompts.py: held_apart) are never here",
    }
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"{len(ordered)} answers, {manifest['answer_tokens']} tokens -> {corpus}", file=sys.stderr)


if __name__ == "__main__":
    main()
