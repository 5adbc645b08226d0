#!/usr/bin/env bash
# A bounded cargo-fuzz run (nightly, libFuzzer, debug assertions on) of the control-message
# decoders. Without the nightly toolchain, or when cargo-fuzz is missing and cannot be installed,
# it prints a SKIP line and exits 0. Exits non-zero when a target crashes (panic, failed
# assertion, overflow, or an input that runs longer than 10 s, or past its -rss_limit_mb).
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
#
# Both targets run at the same time, each for KVLINK_FUZZ_SECONDS (default 60), seeded from every
# directory under kvlink-proto/tests/corpus/ (the malformed frames in wire/, valid frames of
# every type in valid/, batches of valid frames in batch/, a sealed worker address in
# worker_address/, and any regression cases). libFuzzer runs each seed before it mutates, so every input
# committed there is a regression test of both targets.
#
# A crash is left in fuzz/artifacts/<target>/ and printed as hex. To keep it as a regression:
# minimise it (`cargo +nightly fuzz tmin --fuzz-dir fuzz <target> <file>`), fix the bug, and
# commit it under kvlink-proto/tests/corpus/ (a malformed frame goes in wire/ there, named
# <WireReason>__<what>.bin, which kvlink-proto/tests/proto_wire.rs checks on stable too).
#
# Environment: KVLINK_FUZZ_SECONDS (default 60), KVLINK_FUZZ_TARGET_DIR (default
# <repo>/target-fuzz), KVLINK_FUZZ_WORK_DIR (default fuzz/corpus: the corpus libFuzzer grows; kept
# between runs, git-ignored).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
# `cargo +nightly` must not download a toolchain (rustup would, silently, by default): a missing
# nightly is a SKIP.
export RUSTUP_AUTO_INSTALL=0

if ! command -v cargo >/dev/null 2>&1 || ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: SKIP (no nightly Rust toolchain; install it with: rustup toolchain install nightly)"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: cargo-fuzz not found; installing it (cargo install cargo-fuzz --locked)"
    if ! cargo install cargo-fuzz --locked; then
        echo "fuzz: SKIP (cargo-fuzz is missing and could not be installed)"
        exit 0
    fi
fi

seconds="${KVLINK_FUZZ_SECONDS:-60}"
tgt="${KVLINK_FUZZ_TARGET_DIR:-$root/target-fuzz}"
work="${KVLINK_FUZZ_WORK_DIR:-$root/fuzz/corpus}"
artifacts="$root/fuzz/artifacts"
targets=(wire_decode handshake)
# No sanitizer: the targets run only the protocol core (the crate kvlink-proto, which forbids
# `unsafe`), so AddressSanitizer had nothing to watch there; safe Rust's own checks, debug
# assertions and overflow checks included, stay on. Without it the build takes less time and
# each target runs more inputs in its seconds. The `unsafe` code (transport, engine, bridge) is
# checked under AddressSanitizer by scripts/sanitize.sh.
fuzz=(cargo +nightly fuzz)
common=(--fuzz-dir "$root/fuzz" --target-dir "$tgt" --sanitizer none)

seeds=()
for d in "$root"/kvlink-proto/tests/corpus/*/; do
    seeds+=("${d%/}")
done

echo "fuzz: $(cargo +nightly fuzz --version), ${seconds}s per target, seeds: ${seeds[*]#"$root/"}"
t0=$SECONDS
# Start from the main crate's lock (fuzz/Cargo.lock is git-ignored): the targets then build the
# same dependency versions as the tested crate, and cargo only adds libfuzzer-sys and its deps.
cp "$root/Cargo.lock" "$root/fuzz/Cargo.lock"
"${fuzz[@]}" build "${common[@]}"
echo "fuzz: built in $((SECONDS - t0))s"

t1=$SECONDS
pids=()
for t in "${targets[@]}"; do
    mkdir -p "$work/$t" "$artifacts/$t"
    rm -f "$artifacts/$t"/crash-* "$artifacts/$t"/leak-* "$artifacts/$t"/timeout-* \
        "$artifacts/$t"/oom-*
    # The first corpus directory is where libFuzzer writes; the seed directories are only read.
    "${fuzz[@]}" run "${common[@]}" "$t" "$work/$t" "${seeds[@]}" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$artifacts/$t/" >"$artifacts/$t.log" 2>&1 &
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
            echo "reproduce: cargo +nightly fuzz run --fuzz-dir fuzz $t $f"
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
        "kvlink-proto/tests/corpus/)"
    exit 1
fi
echo "fuzz: no crashes"
