#!/usr/bin/env bash
# The main job: installs what it needs (Debian 12), builds the C++ demo against kvlink through
# CMake (Release), and runs it. Arguments go to the demo: --transport tcp|sm|auto|<UCX list>
# [@devices] (default tcp), --timeout-ms N (default 2000), --metrics-file PATH.
#
# examples/kvlink_demo.cpp: a context process and a generation process on loopback hand over a
# KV-cache-shaped request through kvlink's C++ API (advertisement, ready signal, multi-buffer
# transfer, every byte verified); the next request's data is dropped by a fault hook and ends
# TimedOut at its deadline on both sides; the same processes then serve a third request.
# (src/bin/kvlink-demo.rs is the same scenario through the Rust API: cargo run --bin kvlink-demo.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
build="${KVLINK_DEMO_BUILD_DIR:-$root/build-demo}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKVLINK_BUILD_TESTS=OFF -DKVLINK_INSTALL=OFF -DKVLINK_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$build" --target kvlink_demo
exec "$build/kvlink_demo" "$@"
