#!/usr/bin/env bash
# The Vulkan build on Mesa's software Vulkan device (lavapipe), which any x86 machine has
# without a GPU: installs what the build needs (setup-vulkan.sh), builds into target-vulkan/
# (a second llama.cpp build, ~15 minutes on 2 cores the first time), and runs the GPU tests
# (tests/gpu_backend.rs) on lavapipe only. Needs models/ (fetch-models.sh smollm2).
# Usage: tests/support/vulkan.sh [cargo test args after --]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bash "$root/tests/support/setup-vulkan.sh" >/dev/null
export VULKAN_SDK="$root/.vulkan-sdk" CARGO_TARGET_DIR="$root/target-vulkan"
# lavapipe alone: its manifest is the only driver the loader reads
icd=$(compgen -G "/usr/share/vulkan/icd.d/lvp_icd*.json" | head -n 1)
export VK_DRIVER_FILES="$icd" VK_ICD_FILENAMES="$icd" GGML_VK_VISIBLE_DEVICES=0
# lavapipe's batch kernels round differently from its single-row ones (BENCHMARKS.md)
export DFLASH2_EXPECT_INEXACT_DEVICE=1
cd "$root"
cargo build --release --features vulkan
cargo test --release --features vulkan --test gpu_backend -- --test-threads=1 "$@"
