#!/usr/bin/env bash
# Where a request's time goes, stage by stage: builds kvlink-bench with kvlink's `timeline`
# feature (its own target dir, target/timeline), runs one pair of `kvlink-bench peer` processes
# (whole requests, one in flight, the bench's checked patterns), and lines up both processes'
# stage marks (scripts/timeline.py). A mark costs 30-50 ns: the path reads about half a
# microsecond longer than the bench's row.
#   bash scripts/timeline.sh [TRANSPORT [SIZE [REQUESTS]]]      # default: sm 4KiB 4000
# As kvlink-bench's rows (`--pin`), each process runs on CPUs of its own where this machine
# lets us use two or more (cores 0..N-1): the generation side (receiving) on the first half,
# the context side (sending) on the second; PIN=0 leaves placement to the scheduler.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
transport="${1:-sm}" size="${2:-4KiB}" requests="${3:-4000}"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
export CARGO_TARGET_DIR="$root/target/timeline"
cargo build --locked --release -p kvlink-bench --features timeline --manifest-path "$root/Cargo.toml" >&2
bin="$CARGO_TARGET_DIR/release/kvlink-bench"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
args=(--transport "$transport" --size "$size" --inflight 1 --rounds "$requests" --warmup 1000)

pin_ctx=() pin_gen=()
allowed="$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status)"
n="$(nproc)"
if [[ "${PIN:-1}" != 0 && $n -ge 2 && "$allowed" == "0-$((n - 1))" ]] && command -v taskset >/dev/null; then
    half=$(((n + 1) / 2))
    # The receiving side (generation) on the first half, the sending side on the second, as
    # kvlink-bench pins its pairs.
    pin_gen=(taskset -c "0-$((half - 1))")
    pin_ctx=(taskset -c "$half-$((n - 1))")
fi

mkfifo "$out/addr"
KVLINK_TIMELINE="$out/ctx" "${pin_ctx[@]}" "$bin" peer --role ctx "${args[@]}" >"$out/addr" 2>"$out/ctx.err" &
ctx=$!
exec 3<"$out/addr"
addr=""
while read -r line <&3; do
    case "$line" in ADDR*) addr="${line#ADDR }"; break ;; esac
done
if [[ -z "$addr" ]]; then
    echo "timeline: the context side gave no address" >&2
    cat "$out/ctx.err" >&2
    exit 1
fi
status=0
KVLINK_TIMELINE="$out/gen" "${pin_gen[@]}" "$bin" peer --role gen "${args[@]}" --peer "$addr" >"$out/gen.out" 2>"$out/gen.err" || status=$?
cat <&3 >/dev/null || true
wait "$ctx" || status=$?
if [[ $status -ne 0 || ! -s "$out/gen" || ! -s "$out/ctx" ]]; then
    echo "timeline: the pair failed (status $status)" >&2
    cat "$out/gen.err" "$out/ctx.err" >&2
    exit 1
fi
grep -h '^RESULT' "$out/gen.out" | python3 -c '
import json, sys
for l in sys.stdin:
    j = json.loads(l.split(" ", 1)[1])
    p50, failed = j.get("us_p50") or 0, j.get("failed")
    print(f"bench row (marks included): {p50:.2f} us per request p50, failed {failed}")
'
echo "$transport, $size, $requests requests one at a time:"
python3 "$root/scripts/timeline.py" "$out/gen" "$out/ctx"
