#!/usr/bin/env bash
# Installs what building and testing kvlink needs on Debian 12 (bookworm), and nothing when it is
# all there already (a dpkg query: well under a second). Shared by scripts/demo.sh,
# scripts/test-all.sh and .ci/run.
#
#   system packages (apt-get, non-interactive; root, or sudo when available)
#   a Rust toolchain with rustfmt and clippy (rustup) when `cargo` is not found
#   the Python package prometheus_client (pip), which the metrics ctest parses with
#
# Set KVLINK_SKIP_DEPS=1 to skip everything (e.g. on a machine set up another way).
set -euo pipefail

if [[ "${KVLINK_SKIP_DEPS:-0}" == "1" ]]; then
    echo "install-deps: skipped (KVLINK_SKIP_DEPS=1)"
    exit 0
fi

# g++/make: the cxx bridge and the C++ tests; pkg-config + libucx-dev: UCX bindings and link;
# clang + libclang-dev: bindgen; libclang-rt-dev: clang's libFuzzer and sanitizer runtimes, which
# the C++ fuzz target links (scripts/fuzz.sh; Debian ships them apart from clang); cmake +
# ninja-build + libgtest-dev: the C++ package and tests; ucx-utils: ucx_info/ucx_perftest;
# iptables + iproute2: network fault tests.
packages=(g++ make pkg-config cmake ninja-build libucx-dev ucx-utils libgtest-dev
          clang libclang-dev libclang-rt-dev iptables iproute2)

export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
need_rust=0
command -v cargo >/dev/null 2>&1 || need_rust=1
if [[ $need_rust -eq 1 ]]; then
    packages+=(ca-certificates curl)
fi

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ $(id -u) -eq 0 ]]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "install-deps: missing packages (${missing[*]}) and not root; install them as root" >&2
        exit 1
    fi
    echo "install-deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -q
    "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "install-deps: system packages present"
fi

if [[ $need_rust -eq 1 ]]; then
    # Debian's rustc (1.63) is older than the crate's rust-version (1.82): use rustup.
    echo "install-deps: installing Rust (rustup, stable, with rustfmt and clippy)"
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
        sh -s -- -y --profile minimal --default-toolchain stable --component rustfmt,clippy
elif command -v rustup >/dev/null 2>&1; then
    if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
        rustup component add rustfmt clippy
    fi
fi

# The metrics ctest (kvlink.demo.metrics) parses the demo's metrics with prometheus_client's
# Prometheus text parser. Without it that test fails (loudly, not skipped): say so here too.
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import prometheus_client' >/dev/null 2>&1; then
    echo "install-deps: installing prometheus_client (pip)"
    if ! python3 -m pip install --quiet prometheus_client; then
        echo "install-deps: WARNING: pip could not install prometheus_client; kvlink.demo.metrics will fail" >&2
    fi
fi
