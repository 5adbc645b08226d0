#!/usr/bin/env bash
# Checks kvlink as a CMake package the way the README documents it, and prints a summary:
#   1. the README's Release line (configure + build with every default); a plain
#      `cargo build --release` then the same CMake build must not recompile kvlink (shared-target);
#      ctest on it, and the TensorRT-LLM wrapper it built must carry no debug info;
#   2. configure + build + `cmake --install` with tests, demo and wrapper all OFF, into a fresh
#      prefix: the build must still produce the library, and the installed .a must carry no
#      debug info (KVLINK_DEBUG_INFO is OFF by default);
#   3. the consumer project (cpp_tests/consumer) against that prefix alone: find_package(kvlink)
#      must report the version and the UCX it was built against, and the program must run;
#   4. the same consumer with the environment variable KVLINK_UCX_ROOT naming another UCX prefix
#      (links to the UCX of the build, so nothing else differs): it must link and load that one,
#      as the build does with the same variable;
#   5. the same consumer adding kvlink as a subdirectory while it compiles with the old libstdc++
#      string ABI (-D_GLIBCXX_USE_CXX11_ABI=0, as TensorRT-LLM with USE_CXX11_ABI=OFF): the C++
#      cargo compiles into the .a must follow it, or kvlink::version() does not link.
# Both builds use the release profile and one cargo target dir, so Rust compiles at most once
# (not at all when `cargo build --release` or scripts/bench.sh already ran on the same tree).
# Step 5 shares that dir too and comes last: cargo recompiles cxx and kvlink with the old ABI for
# it (about 20 s), and once more for the next default release build of the tree.
# Steps whose prerequisite failed are reported as skipped; the exit status is non-zero if any
# step failed.
#
# Environment: CARGO_TARGET_DIR (default <repo>/target), KVLINK_PKG_DIR (default
# <repo>/build-pkg: release/, off/, prefix/, consumer/ under it), KVLINK_PKG_FRESH=1 to start
# the Release build dir from scratch too (the all-OFF build and the prefix always are),
# KVLINK_SKIP_DEPS=1 to skip installing dependencies, KVLINK_UCX_ROOT to build against that UCX.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
work="${KVLINK_PKG_DIR:-$root/build-pkg}"
jobs="$(nproc 2>/dev/null || echo 2)"

bash "$root/scripts/install-deps.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

build_rel="$work/release"
build_off="$work/off"
prefix="$work/prefix"
version="$(sed -n 's/^version *= *"\([0-9.]*\)".*/\1/p' Cargo.toml | head -n1)"
# The UCX the builds below compile against: KVLINK_UCX_ROOT's (its ucx.pc's Version: line; its
# prefix= is not used), else the system one.
if [[ -n "${KVLINK_UCX_ROOT:-}" ]]; then
    ucx_version="$(sed -n 's/^Version: *//p' "$KVLINK_UCX_ROOT"/lib*/pkgconfig/ucx.pc | head -n1)"
else
    ucx_version="$(pkg-config --modversion ucx)"
fi

ucx_alias="$work/ucx-alias"
rm -rf "$build_off" "$prefix" "$work/consumer" "$work/consumer-ucx-env" "$work/consumer-old-abi" \
    "$ucx_alias"
if [[ "${KVLINK_PKG_FRESH:-0}" == "1" ]]; then rm -rf "$build_rel"; fi
mkdir -p "$work"

# shellcheck source=scripts/steps.sh
source "$root/scripts/steps.sh"

# FILE exists and has no .debug_* sections (KVLINK_DEBUG_INFO is OFF by default).
no_debug_info() {
    local file="$1" debug_sections
    if [[ ! -f "$file" ]]; then
        echo "no $file"; return 1
    fi
    debug_sections="$(readelf -S -W "$file" | grep -c ' \.debug_' || true)"
    echo "$file: $(stat -c %s "$file") bytes, $debug_sections debug sections"
    [[ "$debug_sections" == 0 ]]
}

# The installed library: present, and without .debug_* sections unless asked for.
check_installed_lib() {
    local lib
    lib="$(find "$prefix" -name libkvlink.a | head -n1)"
    if [[ -z "$lib" ]]; then
        echo "no libkvlink.a under $prefix"; return 1
    fi
    no_debug_info "$lib"
}

# 1. The README's line, word for word but for the cargo target dir (shared, so Rust builds once).
step release-build -- bash -c "cmake -S '$root' -B '$build_rel' -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKVLINK_CARGO_TARGET_DIR='$CARGO_TARGET_DIR' -DKVLINK_UCX_ROOT='${KVLINK_UCX_ROOT:-}' \
    && cmake --build '$build_rel' -j $jobs"
# CI's `cargo test` and CMake builds share the target dir: a default CMake build must hand cargo
# the environment a plain cargo build has, or cargo reruns build.rs and recompiles kvlink.
shared_target_no_rebuild() {
    local out rc=0
    cargo build --locked --lib --release || return 1
    out="$(cmake --build "$build_rel" 2>&1)" || rc=$?
    echo "$out"
    if [[ $rc -ne 0 ]]; then return 1; fi
    if grep -q 'Compiling kvlink ' <<<"$out"; then
        echo "the CMake build recompiled kvlink right after a plain cargo build"; return 1
    fi
}
step shared-target requires=release-build -- shared_target_no_rebuild
step release-ctest requires=release-build -- \
    ctest --test-dir "$build_rel" --output-on-failure -j "$jobs" --repeat until-pass:2  # see test-all.sh
# The TensorRT-LLM wrapper carries the same Rust standard library: no debug info either.
step release-wrapper requires=release-build -- no_debug_info "$build_rel/libkvlink_trtllm_wrapper.so"

# 2. Every option OFF but the install rules: build must still run cargo, install must find the .a.
step off-configure -- cmake -S "$root" -B "$build_off" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKVLINK_BUILD_TESTS=OFF -DKVLINK_BUILD_EXAMPLES=OFF -DKVLINK_BUILD_TRTLLM_WRAPPER=OFF \
    -DKVLINK_CARGO_TARGET_DIR="$CARGO_TARGET_DIR" -DKVLINK_UCX_ROOT="${KVLINK_UCX_ROOT:-}"
step off-build requires=off-configure -- cmake --build "$build_off" -j "$jobs"
step off-install requires=off-build -- cmake --install "$build_off" --prefix "$prefix"
step installed-lib requires=off-install -- check_installed_lib

# 3. A consumer that sees only the prefix.
step consumer requires=off-install -- cmake -DMODE=prefix -DPREFIX="$prefix" \
    -DCONSUMER_SOURCE_DIR="$root/cpp_tests/consumer" -DWORK_DIR="$work/consumer" \
    -DGENERATOR=Ninja -DCONFIG=Release -DEXPECTED_VERSION="$version" \
    -DEXPECTED_UCX_VERSION="$ucx_version" -P "$root/cpp_tests/consumer/run_consumer.cmake"

# 4. A consumer that names its UCX in the environment, the way README's "Which UCX" sets it for
# the build. That prefix is made of links to the UCX the package was built against.
consumer_ucx_env() {
    local inc lib d
    if [[ -n "${KVLINK_UCX_ROOT:-}" ]]; then
        inc="$KVLINK_UCX_ROOT/include"
        lib="$(dirname "$(ls "$KVLINK_UCX_ROOT"/lib*/libucp.so | head -n1)")"
    else
        inc="$(pkg-config --variable=includedir ucx)"
        lib="$(pkg-config --variable=libdir ucx)"
    fi
    mkdir -p "$ucx_alias/include" "$ucx_alias/lib"
    for d in ucp uct ucs ucm; do ln -s "$inc/$d" "$ucx_alias/include/$d"; done
    ln -s "$lib"/libuc[pstm]*.so* "$ucx_alias/lib/"
    if [[ -d "$lib/ucx" ]]; then ln -s "$lib/ucx" "$ucx_alias/lib/ucx"; fi
    KVLINK_UCX_ROOT="$ucx_alias" cmake -DMODE=prefix -DPREFIX="$prefix" \
        -DCONSUMER_SOURCE_DIR="$root/cpp_tests/consumer" -DWORK_DIR="$work/consumer-ucx-env" \
        -DGENERATOR=Ninja -DCONFIG=Release -DEXPECTED_VERSION="$version" \
        -DEXPECTED_UCX_VERSION="$ucx_version" -DEXPECTED_UCX_LIBDIR="$ucx_alias/lib" \
        -P "$root/cpp_tests/consumer/run_consumer.cmake"
}
step consumer-ucx-env requires=off-install -- consumer_ucx_env

# 5. A parent on the old libstdc++ string ABI adds kvlink as a subdirectory (KvlinkCargo.cmake
# passes the ABI to cargo's C++ build). Last: it rebuilds cxx and kvlink in the shared target dir.
step consumer-old-abi -- cmake -DMODE=subdirectory -DKVLINK_SOURCE_DIR="$root" \
    -DCARGO_TARGET_DIR="$CARGO_TARGET_DIR" -DUCX_ROOT="${KVLINK_UCX_ROOT:-}" \
    -DCXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=0 \
    -DCONSUMER_SOURCE_DIR="$root/cpp_tests/consumer" -DWORK_DIR="$work/consumer-old-abi" \
    -DGENERATOR=Ninja -DCONFIG=Release -DEXPECTED_VERSION="$version" \
    -DEXPECTED_UCX_VERSION="$ucx_version" -P "$root/cpp_tests/consumer/run_consumer.cmake"

finish package-check "package-check summary (kvlink $version, UCX $ucx_version)"
