#!/usr/bin/env bash
# Build llama-server from the very llama.cpp that dflash2 bundles, as the peer of every side-by-side
# figure (BENCHMARKS.md names this script). The crate (llama-cpp-sys-2) ships llama.cpp's library
# sources but not tools/server; the llama-cpp-python 0.3.36 sdist on PyPI (the only place these
# machines reach) ships a whole llama.cpp tree of about the same age. So: unpack that tree, copy the
# crate's bundled src/, common/, ggml/ and include/ over it, and build the llama-server target with
# llama.cpp's own defaults (Release, GGML_NATIVE, llamafile's sgemm on: what a user of llama-server
# gets; dflash2 itself builds with GGML_LLAMAFILE=OFF, see .cargo/config.toml). No web UI (it would
# be fetched from a hub).
#
# Usage: tests/support/build-llama-server.sh [WORK_DIR]   (default ./work/llama-server)
# Prints the path of the llama-server binary on its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-$root/work/llama-server}
py=${PYTHON:-python3}
mkdir -p "$work"
work=$(cd "$work" && pwd)

# The bundled tree: the llama-cpp-sys-2 version Cargo.lock pins, in cargo's registry (a build of
# dflash2 has fetched it).
sys_version=$(awk '/^name = "llama-cpp-sys-2"$/ { getline; gsub(/"/, "", $3); print $3 }' "$root/Cargo.lock")
bundled=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"llama-cpp-sys-2-$sys_version"/llama.cpp 2>/dev/null | head -n 1)
if [ -z "$bundled" ] || [ ! -f "$bundled/include/llama.h" ]; then
  echo "error: llama-cpp-sys-2 $sys_version is not in cargo's registry: run 'cargo build --release' first" >&2
  exit 1
fi

tree=$work/llama.cpp
stamp=$work/bundled-from
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$bundled" ]; then
  rm -rf "$work/sdist" "$tree"
  mkdir -p "$work/sdist"
  "$py" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work/sdist"
  tar xzf "$work/sdist"/llama_cpp_python-0.3.36.tar.gz -C "$work/sdist"
  mv "$work/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp" "$tree"
  rm -rf "$work/sdist"
  for part in src common ggml include; do
    rm -rf "${tree:?}/$part"
    cp -r "$bundled/$part" "$tree/$part"
  done
  # The small fixes tools/server needs to compile against the bundled common/ (older than the
  # sdist's): fs_open_ifstream is its newer helper, std::ifstream outside Windows.
  if ! grep -q fs_open_ifstream "$tree/common/common.h"; then
    sed -i 's/fs_open_ifstream(\(params.mcp_servers_config\), std::ios::in)/std::ifstream(\1, std::ios::in)/' "$tree/tools/server/server-mcp.cpp"
  fi
  echo "$bundled" > "$stamp"
fi

cmake -S "$tree" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$work/configure.log"
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 || {
  grep -E "error" "$work/build.log" >&2
  exit 1
}
echo "$work/build/bin/llama-server"
