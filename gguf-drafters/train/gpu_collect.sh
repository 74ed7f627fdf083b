#!/usr/bin/env bash
# Turn what gpu_campaign.py brought back (DIR: ckpt.json, ckpt.safetensors[.NN], corpus.npz, run.log)
# into a checkpoint directory and a GGUF drafter:
#   gpu_collect.sh DIR TARGET.gguf OUT.gguf
set -euo pipefail
dir=$1 target=$2 out=$3
ck=$dir/ckpt
mkdir -p "$ck"
cat "$dir"/ckpt.safetensors* > "$ck/model.safetensors"
python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); json.dump(m["config"], open(sys.argv[2]+"/config.json","w"), indent=2); json.dump(m["training"], open(sys.argv[2]+"/training.json","w"), indent=2)' "$dir/ckpt.json" "$ck"
"${DFLASH2:-target/release/dflash2}" convert --from "$ck" --target "$target" --out "$out" --type q8_0
