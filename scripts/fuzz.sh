#!/usr/bin/env bash
# A bounded libFuzzer run of the decoders of bytes a peer sends: the control-message decoders
# (cargo-fuzz, nightly, debug assertions on) and the TensorRT-LLM wrapper's request-info decoder
# (clang++ -fsanitize=fuzzer,address,undefined). Each kind of target that cannot be built here
# (no nightly toolchain, cargo-fuzz missing and not installable; no clang++ or its libFuzzer and
# sanitizer runtimes) gets a SKIP line and the others still run; with none, it exits 0. Exits
# non-zero when a target crashes (panic, failed assertion or property, a sanitizer report,
# overflow, or an input that runs longer than 10 s, or past its -rss_limit_mb).
#
#   wire_decode  every decoder of bytes a peer sends: a control frame (decode never panics,
#                whatever decodes re-encodes to the very same bytes), a control batch (split
#                never panics, accounts for every byte, each message checked as a frame) and a
#                sealed worker address (open refuses with a typed error, what opens re-seals to
#                the very same bytes) (fuzz/fuzz_targets/wire_decode.rs)
#   handshake    Hello decode and encode/decode round trip, plus a whole request between two
#                protocol endpoints while a peer neither knows (rank 7) injects frames built
#                from the input: the request must still complete; and the same frames to a peer
#                table with two ranks bound: nothing is bound to the stranger and no binding
#                moves (fuzz/fuzz_targets/handshake.rs)
#   wrapper_wire the request info of a peer's advertisement to the TensorRT-LLM wrapper
#                (wrapper/kvlink_trtllm_wire.hpp): decode reads nothing out of bounds and what it
#                accepts re-encodes to the very same bytes; a header built from the input
#                decodes back to itself (fuzz/cpp/wrapper_wire.cpp, C++, AddressSanitizer and
#                UndefinedBehaviorSanitizer on)
#
# All targets run at the same time, each for KVLINK_FUZZ_SECONDS (default 60). The Rust targets
# are seeded from every directory under kvlink-proto/tests/corpus/ (the malformed frames in
# wire/, valid frames of every type in valid/, batches of valid frames in batch/, a sealed worker
# address in worker_address/, and any regression cases); wrapper_wire from
# fuzz/cpp/wrapper_wire_seeds/ (headers as the wrapper encodes them, and regression cases).
# libFuzzer runs each seed before it mutates, so every input committed there is a regression test.
#
# A crash is left in fuzz/artifacts/<target>/ and printed as hex. To keep it as a regression:
# minimise it (`cargo +nightly fuzz tmin --fuzz-dir fuzz <target> <file>`, or for wrapper_wire
# `<target dir>/cpp/wrapper_wire -minimize_crash=1 <file>`), fix the bug, and commit it under
# kvlink-proto/tests/corpus/ (a malformed frame goes in wire/ there, named
# <WireReason>__<what>.bin, which kvlink-proto/tests/proto_wire.rs checks on stable too), or for
# wrapper_wire under fuzz/cpp/wrapper_wire_seeds/.
#
# Environment: KVLINK_FUZZ_SECONDS (default 60), KVLINK_FUZZ_TARGET_DIR (default
# <repo>/target-fuzz), KVLINK_FUZZ_WORK_DIR (default fuzz/corpus: the corpus libFuzzer grows; kept
# between runs, git-ignored), KVLINK_FUZZ_CXX (default clang++: the compiler of wrapper_wire).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
# `cargo +nightly` must not download a toolchain (rustup would, silently, by default): a missing
# nightly is a SKIP.
export RUSTUP_AUTO_INSTALL=0

seconds="${KVLINK_FUZZ_SECONDS:-60}"
tgt="${KVLINK_FUZZ_TARGET_DIR:-$root/target-fuzz}"
work="${KVLINK_FUZZ_WORK_DIR:-$root/fuzz/corpus}"
artifacts="$root/fuzz/artifacts"
cxx="${KVLINK_FUZZ_CXX:-clang++}"

# --- Which targets can be built here ----------------------------------------------------------
rust_targets=()
if ! command -v cargo >/dev/null 2>&1 || ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: SKIP wire_decode, handshake (no nightly Rust toolchain; install it with:" \
        "rustup toolchain install nightly)"
else
    if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        echo "fuzz: cargo-fuzz not found; installing it (cargo install cargo-fuzz --locked)"
        cargo install cargo-fuzz --locked || true
    fi
    if cargo +nightly fuzz --version >/dev/null 2>&1; then
        rust_targets=(wire_decode handshake)
    else
        echo "fuzz: SKIP wire_decode, handshake (cargo-fuzz is missing and could not be installed)"
    fi
fi

cpp_targets=()
cpp_flags=(-std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all)
if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "fuzz: SKIP wrapper_wire (no $cxx; on Debian: apt-get install clang libclang-rt-dev)"
else
    # The compiler alone is not enough: -fsanitize=fuzzer links libFuzzer and the sanitizers'
    # runtimes, which Debian ships apart from clang (libclang-rt-dev, scripts/install-deps.sh).
    mkdir -p "$tgt/cpp"
    printf '%s\n' '#include <cstddef>' '#include <cstdint>' \
        'extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const*, std::size_t) { return 0; }' \
        >"$tgt/cpp/probe.cpp"
    if ! "$cxx" "${cpp_flags[@]}" "$tgt/cpp/probe.cpp" -o "$tgt/cpp/probe" >"$tgt/cpp/probe.log" 2>&1; then
        echo "fuzz: SKIP wrapper_wire ($cxx cannot link -fsanitize=fuzzer,address,undefined: its" \
            "libFuzzer or sanitizer runtime is missing; on Debian: apt-get install libclang-rt-dev)"
        sed 's/^/    /' "$tgt/cpp/probe.log" | head -n 5
    else
        cpp_targets=(wrapper_wire)
    fi
fi

if [[ ${#rust_targets[@]} -eq 0 && ${#cpp_targets[@]} -eq 0 ]]; then
    echo "fuzz: SKIP (no fuzz target can be built here)"
    exit 0
fi

# --- Build ---------------------------------------------------------------------------------------
# No sanitizer for the Rust targets: they run only the protocol core (the crate kvlink-proto,
# which forbids `unsafe`), so AddressSanitizer had nothing to watch there; safe Rust's own checks,
# debug assertions and overflow checks included, stay on. Without it the build takes less time
# and each target runs more inputs in its seconds. The `unsafe` code (transport, engine, bridge)
# is checked under AddressSanitizer by scripts/sanitize.sh. The C++ target has AddressSanitizer
# and UndefinedBehaviorSanitizer: C++ has no bounds checks of its own.
fuzz=(cargo +nightly fuzz)
common=(--fuzz-dir "$root/fuzz" --target-dir "$tgt" --sanitizer none)

rust_seeds=()
for d in "$root"/kvlink-proto/tests/corpus/*/; do
    rust_seeds+=("${d%/}")
done
cpp_seeds="$root/fuzz/cpp/wrapper_wire_seeds"

t0=$SECONDS
if [[ ${#rust_targets[@]} -gt 0 ]]; then
    echo "fuzz: $(cargo +nightly fuzz --version), ${seconds}s per target, seeds: ${rust_seeds[*]#"$root/"}"
    # Start from the main crate's lock (fuzz/Cargo.lock is git-ignored): the targets then build
    # the same dependency versions as the tested crate, and cargo only adds libfuzzer-sys and its
    # deps.
    cp "$root/Cargo.lock" "$root/fuzz/Cargo.lock"
    "${fuzz[@]}" build "${common[@]}"
fi
if [[ ${#cpp_targets[@]} -gt 0 ]]; then
    echo "fuzz: $("$cxx" --version | head -n1), ${seconds}s per target, seeds: ${cpp_seeds#"$root/"}"
    "$cxx" "${cpp_flags[@]}" -Wall -Wextra -Werror -I "$root/wrapper" "$root/fuzz/cpp/wrapper_wire.cpp" \
        -o "$tgt/cpp/wrapper_wire"
fi
echo "fuzz: built in $((SECONDS - t0))s"

# --- Run, all targets side by side ------------------------------------------------------------
t1=$SECONDS
targets=()
pids=()
reproduce=()
for t in "${rust_targets[@]}" "${cpp_targets[@]}"; do
    mkdir -p "$work/$t" "$artifacts/$t"
    rm -f "$artifacts/$t"/crash-* "$artifacts/$t"/leak-* "$artifacts/$t"/timeout-* \
        "$artifacts/$t"/oom-*
    libfuzzer=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$artifacts/$t/")
    # The first corpus directory is where libFuzzer writes; the seed directories are only read.
    if [[ $t == wrapper_wire ]]; then
        "$tgt/cpp/$t" "$work/$t" "$cpp_seeds" "${libfuzzer[@]}" >"$artifacts/$t.log" 2>&1 &
        reproduce+=("$tgt/cpp/$t")
    else
        "${fuzz[@]}" run "${common[@]}" "$t" "$work/$t" "${rust_seeds[@]}" -- "${libfuzzer[@]}" \
            >"$artifacts/$t.log" 2>&1 &
        reproduce+=("cargo +nightly fuzz run --fuzz-dir fuzz $t")
    fi
    targets+=("$t")
    pids+=($!)
done

failed=0
summary=()
for i in "${!targets[@]}"; do
    t="${targets[$i]}"
    rc=0
    wait "${pids[$i]}" || rc=$?
    runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$artifacts/$t.log" | tail -n1)"
    cov="$(grep -o 'cov: [0-9]*' "$artifacts/$t.log" | tail -n1 || true)"
    found=("$artifacts/$t"/crash-* "$artifacts/$t"/leak-* "$artifacts/$t"/timeout-* \
        "$artifacts/$t"/oom-*)
    crashes=()
    for f in "${found[@]}"; do [[ -e "$f" ]] && crashes+=("$f"); done
    if [[ $rc -ne 0 || ${#crashes[@]} -gt 0 ]]; then
        failed=1
        summary+=("$(printf '  %-12s FAIL  %s runs, %s (exit %s)' "$t" "${runs:-?}" "${cov:-cov: ?}" "$rc")")
        echo
        echo "=== fuzz/$t: FAILED; end of its log ($artifacts/$t.log):"
        tail -n 60 "$artifacts/$t.log"
        for f in "${crashes[@]}"; do
            echo "--- $f ($(wc -c <"$f") bytes):"
            od -An -tx1 -v "$f" | head -n 40
            echo "reproduce: ${reproduce[$i]} $f"
        done
    else
        summary+=("$(printf '  %-12s ok    %s runs, %s' "$t" "${runs:-?}" "${cov:-cov: ?}")")
    fi
done

echo
echo "=== fuzz: summary (${seconds}s per target, run side by side in $((SECONDS - t1))s)"
printf '%s\n' "${summary[@]}"
if [[ $failed -ne 0 ]]; then
    echo "fuzz: FAILED (inputs in fuzz/artifacts/; make each a regression case in" \
        "kvlink-proto/tests/corpus/, or for wrapper_wire in fuzz/cpp/wrapper_wire_seeds/)"
    exit 1
fi
echo "fuzz: no crashes"
