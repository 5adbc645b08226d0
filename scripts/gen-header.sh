#!/usr/bin/env bash
# Regenerates the published C++ headers from the cxx bridge:
#   include/kvlink/bridge.h  <- $CARGO_TARGET_DIR/cxxbridge/kvlink/src/bridge.rs.h
#   include/rust/cxx.h       <- $CARGO_TARGET_DIR/cxxbridge/rust/cxx.h
# cxx-build writes those during `cargo build` (as symlinks into OUT_DIR and the registry, so we
# copy contents). Reading the build's output is cheaper than installing the `cxxbridge` CLI and
# is the same cxx version as Cargo.lock by construction.
#
# Usage: scripts/gen-header.sh [OUT_INCLUDE_DIR]   (default: <repo>/include)
# Honours CARGO_TARGET_DIR (default: <repo>/target). Needs no network (--locked, registry cache).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/include}"
target_dir="${CARGO_TARGET_DIR:-$root/target}"

# A dev-profile library build runs build.rs, which (re)writes the cxxbridge output when
# src/bridge.rs changed. When nothing changed this is a no-op of a second or so.
cargo build --quiet --locked --lib --manifest-path "$root/Cargo.toml" --target-dir "$target_dir"

src_bridge="$target_dir/cxxbridge/kvlink/src/bridge.rs.h"
src_cxx="$target_dir/cxxbridge/rust/cxx.h"
for f in "$src_bridge" "$src_cxx"; do
    [[ -e "$f" ]] || { echo "gen-header: $f missing after cargo build" >&2; exit 1; }
done

mkdir -p "$out/kvlink" "$out/rust"
{
    echo "// GENERATED from src/bridge.rs by scripts/gen-header.sh (cxx's code generator)."
    echo "// Do not edit: change src/bridge.rs and rerun the script. CI fails when this file drifts."
    echo "// Include <kvlink/kvlink.hpp> instead: it adds typed errors on top of these declarations."
    # The generated file says `// #include "rust/cxx.h"` (a comment: it inlines what it needs).
    # Nothing else refers to the crate layout, so the content is copied unchanged.
    cat "$src_bridge"
} > "$out/kvlink/bridge.h.tmp"
mv "$out/kvlink/bridge.h.tmp" "$out/kvlink/bridge.h"
cat "$src_cxx" > "$out/rust/cxx.h.tmp"
mv "$out/rust/cxx.h.tmp" "$out/rust/cxx.h"
echo "gen-header: wrote $out/kvlink/bridge.h and $out/rust/cxx.h"
