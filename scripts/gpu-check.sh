#!/usr/bin/env bash
# The checks that need a GPU, in one run: kvlink's Rust device tests (tests/gpu.rs) and the
# TensorRT-LLM wrapper's device-memory test (device pointers through kvlink's device path).
# Elsewhere these tests skip and say why. Usage: scripts/gpu-check.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-gpu}"
nvidia-smi -L || echo "gpu-check: nvidia-smi not found (the tests will say why they skip)"
cargo test --locked --manifest-path "$root/Cargo.toml" --test gpu -- --nocapture
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug
cmake --build "$build" --target kvlink_wrapper_tests
"$build/cpp_tests/kvlink_wrapper_tests" --gtest_filter='*DeviceMemory*'
