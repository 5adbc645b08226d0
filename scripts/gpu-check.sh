#!/usr/bin/env bash
# Every GPU check in one go, for a machine with an NVIDIA GPU and driver (a few minutes):
#   1. what the linked UCX says about CUDA memory (kvlink's device path: Direct or Staged);
#   2. tests/gpu.rs: pinned staging round trip device -> host -> device with the pool reused,
#      and a device-to-device transfer through two engines with every byte checked while
#      another request's staging buffer is held;
#   3. where the UCX has CUDA support (the PyPI wheel's 1.22), ucx_perftest -m cuda tag_bw on
#      loopback as the figure to compare against;
#   4. the TensorRT-LLM wrapper's device-memory test (device pointers through kvlink's device
#      path, never a host memcpy). Usage: scripts/gpu-check.sh [BUILD_DIR] (default build-gpu).
# Without a driver or a GPU each part prints SKIP and why, and the script exits 0.
# KVLINK_UCX_ROOT selects the UCX as for every other build (default: the system UCX).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
status=0

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L
else
    echo "gpu-check: no GPU visible (nvidia-smi -L failed or missing); the tests below SKIP"
fi

echo "=== device path (tests/transport_local.rs::the_device_path_is_what_the_linked_ucx_reports)"
cargo test --locked --test transport_local -- --nocapture the_device_path 2>&1 |
    grep -E "memory types|test result|panicked" || status=1

echo "=== tests/gpu.rs"
cargo test --locked --test gpu -- --nocapture --test-threads 1 2>&1 |
    grep -E "SKIP|^test |test result|panicked" || status=1

echo "=== ucx_perftest -m cuda (tag_bw, 16 MiB, loopback)"
if [[ -n "${KVLINK_UCX_ROOT:-}" && -x "$KVLINK_UCX_ROOT/bin/ucx_perftest" ]]; then
    # The wheel's tools have no rpath to its lib/: without this they load the system UCX.
    export LD_LIBRARY_PATH="$KVLINK_UCX_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    perftest="$KVLINK_UCX_ROOT/bin/ucx_perftest" info="$KVLINK_UCX_ROOT/bin/ucx_info"
else
    perftest=ucx_perftest info=ucx_info
fi
if ! "$info" -d 2>/dev/null | grep -q "Transport: cuda_copy"; then
    echo "SKIP ucx_perftest -m cuda: $("$info" -v 2>/dev/null | grep -i 'version' | head -n1) lists no cuda_copy transport (no CUDA support, or no driver)"
else
    port=$((20000 + RANDOM % 20000))
    "$perftest" -t tag_bw -m cuda -s 16777216 -n 200 -p "$port" >/dev/null 2>&1 &
    server=$!
    sleep 1
    "$perftest" 127.0.0.1 -t tag_bw -m cuda -s 16777216 -n 200 -p "$port" 2>&1 | tail -n 2 || status=1
    wait "$server" 2>/dev/null
fi
echo "=== TensorRT-LLM wrapper: device memory (kvlink_wrapper_tests *DeviceMemory*)"
build="${1:-$root/build-gpu}"
if cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
        ${KVLINK_UCX_ROOT:+-DKVLINK_UCX_ROOT="$KVLINK_UCX_ROOT"} >/dev/null &&
    cmake --build "$build" --target kvlink_wrapper_tests >/dev/null; then
    "$build/cpp_tests/kvlink_wrapper_tests" --gtest_filter='*DeviceMemory*' || status=1
else
    echo "gpu-check: the wrapper tests did not build"; status=1
fi
exit $status
