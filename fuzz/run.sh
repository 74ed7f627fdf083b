#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser of outside bytes: libFuzzer through cargo-fuzz, on the
# stable toolchain (`-s none`: no sanitizer, which would need nightly). Each target runs SECS
# seconds (default 60) from its committed corpus; inputs that reach new code are written to
# fuzz/corpus-work/ and merged into fuzz/corpus/ at the end (commit them). A broken promise stops
# the run with the input in fuzz/artifacts/NAME/: minimise it (`cargo fuzz tmin -s none NAME FILE`),
# fix it, and commit it under fuzz/regressions/NAME/ (tests/fuzz.rs replays both folders).
#
#   bash fuzz/run.sh            # a minute per target (CI runs 20 s each)
#   bash fuzz/run.sh 3600       # a campaign
set -euo pipefail
cd "$(dirname "$0")"
SECS=${1:-60}
TARGETS=${TARGETS:-"gguf http conversations checkpoint"}
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked --version 0.13.2
fi
cargo fuzz build -s none
BIN=target/x86_64-unknown-linux-gnu/release
for t in $TARGETS; do
    mkdir -p "corpus-work/$t" "artifacts/$t"
    echo "== $t: $SECS s"
    "$BIN/$t" -max_total_time="$SECS" -print_final_stats=1 -artifact_prefix="artifacts/$t/" \
        "corpus-work/$t" "corpus/$t" 2>&1 | grep -E "INITED|DONE|stat::number_of_executed_units|panicked|ERROR|SUMMARY|Test unit"
    # keep only what reaches code the committed corpus does not
    "$BIN/$t" -merge=1 "corpus/$t" "corpus-work/$t" 2>&1 | grep -E "MERGE-OUTER: [0-9]+ new files" || true
done
