#!/usr/bin/env bash
# Install what a fresh Debian/Ubuntu machine lacks to build dflash2 and run its tests:
# cmake and libclang (llama.cpp and its bindings), g++ and pkg-config (the C ABI tests),
# tmux (the chat test drives a terminal); with --train also the drafter training environment
# (.venv: torch, numpy, safetensors, gguf from PyPI, ~5 GB; the recipe and its tests need it).
# Needs root (or sudo) only when a Debian package is missing.
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v c++ >/dev/null || need+=(g++)
command -v tmux >/dev/null || need+=(tmux)
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

# the drafter training environment (gguf-drafters/train), kept between runs
[ "${1:-}" = "--train" ] || exit 0
root=$(cd "$(dirname "$0")/../.." && pwd)
if ! "$root/.venv/bin/python" -c 'import torch, numpy, safetensors, gguf' 2>/dev/null; then
  ${PYTHON:-python3} -m venv "$root/.venv"
  "$root/.venv/bin/pip" install -q -r "$root/gguf-drafters/train/requirements.txt"
fi
