#!/usr/bin/env bash
# Whether the kernel's tcp pacing explains a slow tcp row: alternated pairs of raw UCX
# (`ucx_perftest tag_bw -O 1`) and kvlink's transport row (`kvlink-bench peer --role
# tr-recv|tr-send`) at one size over loopback, each printed with its p50 and the machine's
# HRTIMER softirqs over the pair. Under BBR a tcp socket that runs into its pacing rate arms
# `tcp_pace_kick`, which fires in that softirq; an idle machine counts none (bench/src/pacing.rs).
#   bash scripts/tcp-pacing.sh [SIZE_BYTES [PAIRS [TRANSFERS]]]     # default: 16 MiB, 6, 100
# Each pair pinned as kvlink-bench pins its rows (receiver on CPU 0, sender on CPU 1) where the
# machine has two CPUs or more, with the send buffer the bench gives both sides.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
size="${1:-16777216}" pairs="${2:-6}" n="${3:-100}"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
cargo build --locked --release -p kvlink-bench --manifest-path "$root/Cargo.toml" >&2
bin="${CARGO_TARGET_DIR:-$root/target}/release/kvlink-bench"
command -v ucx_perftest >/dev/null || { echo "tcp-pacing: ucx_perftest not found" >&2; exit 1; }
export UCX_TCP_SNDBUF="${UCX_TCP_SNDBUF:-256K}"
recv=() send=()
if [[ "$(nproc)" -ge 2 ]] && command -v taskset >/dev/null; then
    recv=(taskset -c 0) send=(taskset -c 1)
fi
kicks() { awk '/HRTIMER:/ { s = 0; for (i = 2; i <= NF; i++) s += $i; print s }' /proc/softirqs; }
out="$(mktemp -d)"
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$out"' EXIT

perftest() {
    local port=$((20000 + RANDOM % 20000)) before p50
    before="$(kicks)"
    UCX_TLS=tcp "${recv[@]}" ucx_perftest -p "$port" >"$out/srv" 2>&1 &
    local srv=$!
    sleep 0.3
    p50="$(UCX_TLS=tcp "${send[@]}" ucx_perftest 127.0.0.1 -p "$port" -t tag_bw -s "$size" \
        -n "$n" -O 1 -f 2>&1 | awk '$1 ~ /^[0-9]+$/ && NF >= 6 { v = $2 } END { print v }')" || true
    wait "$srv" 2>/dev/null || true
    echo "ucx_perftest tag_bw  p50 ${p50:-?} us  pacing kicks $(($(kicks) - before))"
}

kvlink() {
    local before addr="" line p50
    before="$(kicks)"
    mkfifo "$out/addr"
    "${recv[@]}" "$bin" peer --role tr-recv --transport tcp --size "$size" --rounds "$n" \
        --warmup 3 >"$out/addr" 2>"$out/recv.err" &
    local r=$!
    exec 3<"$out/addr"
    while read -r line <&3; do
        case "$line" in ADDR*) addr="${line#ADDR }"; break ;; esac
    done
    p50="$("${send[@]}" "$bin" peer --role tr-send --transport tcp --size "$size" --rounds "$n" \
        --warmup 3 --peer "$addr" </dev/null 2>"$out/send.err" \
        | sed -n 's/^RESULT .*"us_p50":\([0-9.]*\).*/\1/p')"
    kill -INT "$r" 2>/dev/null || true
    wait "$r" 2>/dev/null || true
    exec 3<&-
    rm -f "$out/addr"
    echo "kvlink transport     p50 ${p50:-?} us  pacing kicks $(($(kicks) - before))"
}

echo "tcp, $size bytes, $n transfers a row, $pairs alternated pairs; congestion control: $(sysctl -n net.ipv4.tcp_congestion_control 2>/dev/null || echo '?')"
for _ in $(seq "$pairs"); do
    perftest
    kvlink
done
