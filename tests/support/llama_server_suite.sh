#!/usr/bin/env bash
# Runs llama.cpp's own server test suite (tools/server/tests, non-slow tests) against `dflash2 serve`
# through tests/support/llama-server, the flag-translating launcher, and writes a per-file summary.
# The suite comes from llama-cpp-python's source package on PyPI (its vendored llama.cpp is the
# closest to the one llama-cpp-sys-2 bundles); it and a venv with the suite's requirements live
# in work/llama-server-suite (git-ignored).
# Usage: tests/support/llama_server_suite.sh [pytest args, e.g. unit/test_basic.py]
# Needs target/release/dflash2 (cargo build --release) and models/ (tests/support/fetch-models.sh smollm2
# and qwen0.5b). Run it under `nice -n 19` on a shared machine: it starts one server per test.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
dir="$root/work/llama-server-suite"
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
tests="$src/tools/server/tests"
py=${PYTHON:-python3}
mkdir -p "$dir"

if [ ! -d "$tests/unit" ]; then
  [ -f "$dir/llama_cpp_python-$version.tar.gz" ] ||
    "$py" -m pip download -q --no-deps --no-binary :all: -d "$dir" "llama-cpp-python==$version"
  tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir" \
    "llama_cpp_python-$version/vendor/llama.cpp/tools/server/tests" \
    "llama_cpp_python-$version/vendor/llama.cpp/models/templates"
fi
if [ ! -x "$dir/venv/bin/pytest" ]; then
  "$py" -m venv "$dir/venv"
  "$dir/venv/bin/pip" install -q -r "$tests/requirements.txt" pytest-timeout
fi
[ -x "$root/target/release/dflash2" ] || { echo "error: build target/release/dflash2 first" >&2; exit 1; }

# The speculative and LoRA tests download their extra model from the hub (unreachable here) unless
# it is in tmp/: placeholders let them reach the launcher, which drafts with SmolLM2's DFlash
# drafter instead and refuses --lora.
mkdir -p "$tests/tmp"
for f in stories15M-q4_0.gguf moe_shakespeare15M.gguf; do
  [ -e "$tests/tmp/$f" ] || echo "placeholder: see tests/support/llama_server_shim.py" > "$tests/tmp/$f"
done

cd "$tests"
export LLAMA_SERVER_BIN_PATH="$root/tests/support/llama-server"
[ $# -gt 0 ] || set -- unit
set +e
"$dir/venv/bin/pytest" -m "not slow" --timeout 300 -p no:cacheprovider -q -rfE \
  --junitxml="$dir/results.xml" "$@" > "$dir/pytest.log" 2>&1
rc=$?
set -e
tail -n 60 "$dir/pytest.log"

# Per test file: passed, failed (failures and errors), skipped.
"$py" - "$dir/results.xml" > "$dir/summary.md" <<'PYEOF'
import collections, sys, xml.etree.ElementTree as ET
counts = collections.defaultdict(lambda: [0, 0, 0])
for case in ET.parse(sys.argv[1]).iter("testcase"):
    name = case.get("classname", "").split(".")[-1] + ".py"
    kind = {c.tag for c in case}
    counts[name][1 if kind & {"failure", "error"} else 2 if "skipped" in kind else 0] += 1
print("| file | passed | failed | skipped |\n|---|---|---|---|")
total = [0, 0, 0]
for name in sorted(counts):
    c = counts[name]
    total = [a + b for a, b in zip(total, c)]
    print(f"| {name} | {c[0]} | {c[1]} | {c[2]} |")
print(f"| all | {total[0]} | {total[1]} | {total[2]} |")
PYEOF
cat "$dir/summary.md"
echo "log: $dir/pytest.log, summary: $dir/summary.md"
exit $rc
