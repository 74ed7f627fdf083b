#!/usr/bin/env bash
# Install what a fresh Debian/Ubuntu machine lacks to build dflash2 and run its tests:
# cmake and libclang (llama.cpp and its bindings), cc/c++ and pkg-config (the shim and the C ABI
# tests), tmux (the chat test drives a terminal), curl (server tests), Chromium and chromedriver (the
# chat page's test drives a headless browser), python3 with pip and venv
# (models come from PyPI; the OpenAI SDK test makes a venv); with --train also the drafter training
# environment (.venv: torch, numpy, safetensors, gguf from PyPI, ~5 GB; the recipe and its tests need it).
# Each check tests the very thing the build or a test uses, not something with a similar name.
# Needs root (or sudo) only when a Debian package is missing.
set -euo pipefail
py=${PYTHON:-python3}
source "$(dirname "$0")/apt.sh"

# bindgen (clang-sys) dlopens libclang.so or libclang-N.so[.M] (never libclang-cpp*, which is
# another library) and parses llama.h with clang's own resource headers (stddef.h), which ship in
# libclang-common-N-dev: libclang-dev brings both. LIBCLANG_PATH, when set, is where it looks first.
have_libclang() {
  if [ -n "${LIBCLANG_PATH:-}" ]; then
    compgen -G "$LIBCLANG_PATH/libclang.so*" >/dev/null || compgen -G "$LIBCLANG_PATH/libclang-[0-9]*.so*" >/dev/null
    return
  fi
  if command -v dpkg-query >/dev/null; then
    [ "$(dpkg-query -W -f='${Status}' libclang-dev 2>/dev/null)" = "install ok installed" ]
    return
  fi
  compgen -G "/usr/lib/llvm-*/lib/libclang.so" >/dev/null && compgen -G "/usr/lib/llvm-*/lib/clang/*/include/stddef.h" >/dev/null
}

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v cc >/dev/null || need+=(gcc)
command -v c++ >/dev/null || need+=(g++)
command -v tmux >/dev/null || need+=(tmux)
command -v curl >/dev/null || need+=(curl)
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
command -v "$py" >/dev/null || need+=(python3)
have_libclang || need+=(libclang-dev)
apt_install "${need[@]}"
# pip and venv are modules of the interpreter the scripts run, not commands on PATH
if ! "$py" -m pip --version >/dev/null 2>&1 || ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
  apt_install python3-pip python3-venv
fi

# the drafter training environment (gguf-drafters/train), kept between runs
[ "${1:-}" = "--train" ] || exit 0
root=$(cd "$(dirname "$0")/../.." && pwd)
if ! "$root/.venv/bin/python" -c 'import torch, numpy, safetensors, gguf, matplotlib' 2>/dev/null; then
  "$py" -m venv "$root/.venv"
  "$root/.venv/bin/pip" install -q -r "$root/gguf-drafters/train/requirements.txt"
fi
