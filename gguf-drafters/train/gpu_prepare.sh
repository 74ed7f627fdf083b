#!/usr/bin/env bash
# Prepare .gpu/ (git-ignored through .git/info/exclude) for a drafter campaign on a GPU machine
# that can fetch nothing and takes at most 64 MiB of tree per call (README.md of this folder,
# "On a GPU machine"): the prompts rendered and tokenized by llama.cpp, the `gguf` wheel, the
# target split in two halves (one per call), and a synthetic target for a first smoke run.
#   gpu_prepare.sh TARGET.gguf
set -euo pipefail
target=$1
root=$(git rev-parse --show-toplevel)
cd "$root"
bin=${DFLASH2:-target/release/dflash2}
py=${PYTHON:-.venv/bin/python}
mkdir -p .gpu work/gpu
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude

"$py" gguf-drafters/train/make_prompts.py --out work/gpu/prompts-all.jsonl --stdlib 100000 --sharegpt 100000
port=18099
"$bin" serve -m "$target" --port $port -np 1 -c 4096 >work/gpu/serve.log 2>&1 &
srv=$!
trap 'kill $srv 2>/dev/null' EXIT
for _ in $(seq 60); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
python3 gguf-drafters/train/tokenize_prompts.py --prompts work/gpu/prompts-all.jsonl \
    --server http://127.0.0.1:$port --out .gpu/prompts-ids.jsonl.gz

"$py" -m pip download -q --no-deps --only-binary=:all: -d .gpu gguf==0.19.0
"$bin" synth --out work/gpu/synth >/dev/null
cp work/gpu/synth/target.gguf .gpu/smoke-target.gguf
"$py" - <<'PY'
import gguf, gzip, json, random
r = gguf.GGUFReader(".gpu/smoke-target.gguf")
n = int([t for t in r.tensors if t.name == "token_embd.weight"][0].shape[1])
rng = random.Random(0)
with gzip.open(".gpu/smoke-prompts.jsonl.gz", "wt") as f:
    for i in range(200):
        ids = [rng.randrange(4, n) for _ in range(rng.randrange(8, 40))]
        f.write(json.dumps({"source": "smoke", "prompt": f"p{i}", "ids": ids}) + "\n")
PY
size=$(stat -c %s "$target")
head -c $((size / 2)) "$target" > .gpu/target.part1
tail -c +$((size / 2 + 1)) "$target" > .gpu/target.part2
echo "sha256 of the target: $(sha256sum "$target" | cut -d' ' -f1)"
ls -la .gpu
