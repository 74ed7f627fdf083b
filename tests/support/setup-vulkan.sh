#!/usr/bin/env bash
# What a Debian 12 machine lacks to build dflash2 with `--features vulkan` and run it on Mesa's
# software Vulkan device (lavapipe), after setup.sh:
#   - glslc (llama.cpp compiles its shaders with it), SPIRV-Headers (ggml-vulkan's find_package),
#     the Vulkan loader (libvulkan.so), Mesa's Vulkan drivers (lavapipe: a Vulkan device on the CPU);
#   - Vulkan headers newer than Debian 12's 1.3.239, which lacks VK_EXT_layer_settings: Debian 13's
#     libvulkan-dev (1.4.309) is unpacked, headers only, into .vulkan-sdk/ (checked against the
#     archive's SHA-256), next to a link to the system loader. Nothing system-wide is replaced.
# Prints the line to build with: VULKAN_SDK=... cargo build --release --features vulkan.
# Each check tests the very file the build uses.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$(dirname "$0")/apt.sh"
sdk="$root/.vulkan-sdk"
arch=$(dpkg --print-architecture)
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)

need=()
command -v glslc >/dev/null || need+=(glslc)
# ggml-vulkan: find_package(SPIRV-Headers CONFIG)
compgen -G "/usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null \
  || compgen -G "/usr/lib/$multiarch/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null \
  || need+=(spirv-headers)
[ -e "/usr/lib/$multiarch/libvulkan.so.1" ] || need+=(libvulkan1)
# lavapipe's ICD manifest is what the loader reads to find the software device
compgen -G "/usr/share/vulkan/icd.d/lvp_icd*.json" >/dev/null || need+=(mesa-vulkan-drivers)
command -v xz >/dev/null || need+=(xz-utils)
apt_install "${need[@]}"

# headers: the file llama.cpp needs the extension from
if ! grep -qs VK_EXT_layer_settings "$sdk/include/vulkan/vulkan_core.h" || [ ! -e "$sdk/include/vulkan/vulkan.hpp" ]; then
  mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "setup-vulkan: fetching Debian 13's libvulkan-dev for its headers" >&2
  curl -fsSL "$mirror/dists/trixie/main/binary-$arch/Packages.xz" | xz -d > "$tmp/Packages"
  entry=$(awk '/^Package: libvulkan-dev$/{p=1} p&&/^$/{exit} p' "$tmp/Packages")
  file=$(sed -n 's/^Filename: //p' <<<"$entry")
  sum=$(sed -n 's/^SHA256: //p' <<<"$entry")
  [ -n "$file" ] && [ -n "$sum" ] || { echo "setup-vulkan: libvulkan-dev not in trixie's index" >&2; exit 1; }
  curl -fsSL "$mirror/$file" -o "$tmp/dev.deb"
  echo "$sum  $tmp/dev.deb" | sha256sum -c --quiet
  dpkg-deb -x "$tmp/dev.deb" "$tmp/x"
  rm -rf "$sdk"
  mkdir -p "$sdk/lib"
  cp -r "$tmp/x/usr/include" "$sdk/include"
  grep -qs VK_EXT_layer_settings "$sdk/include/vulkan/vulkan_core.h"
fi
# FindVulkan looks for the loader in $VULKAN_SDK/lib
ln -sf "/usr/lib/$multiarch/libvulkan.so.1" "$sdk/lib/libvulkan.so"
echo "setup-vulkan: ready; build with:" >&2
echo "VULKAN_SDK=$sdk cargo build --release --features vulkan"
