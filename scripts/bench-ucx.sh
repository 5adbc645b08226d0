#!/usr/bin/env bash
# kvlink-bench on two UCX generations in one run: built against the system UCX (Debian's 1.13)
# and against the PyPI wheel's UCX 1.22 (scripts/ucx-wheel.sh), each measured against its own
# ucx_perftest (the bench runs the tools of the UCX it is linked against), then one table side
# by side. Each generation has its own cargo target dir (release builds). Arguments go to both
# kvlink-bench runs (`--help` explains them); the default is a short run:
#   bash scripts/bench-ucx.sh                       # --iters 30 --rounds 2 --inflight 4KiB:64,1MiB:8, tcp and sm
#   bash scripts/bench-ucx.sh --iters 100 --rounds 5
# Output: <out>/ucx113.json, <out>/ucx122.json and the markdown table on stdout, where <out> is
# KVLINK_BENCH_OUT (default <repo>/build-bench). Noisy on a shared 2-core machine: compare the
# ratios of one run, not runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash "$root/scripts/install-deps.sh" >&2
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
out="${KVLINK_BENCH_OUT:-$root/build-bench}"
mkdir -p "$out"
args=("$@")
[[ ${#args[@]} -eq 0 ]] && args=(--iters 30 --rounds 2 --inflight 4KiB:64,1MiB:8)
target="${CARGO_TARGET_DIR:-$root/target}"
ucx122_root="$(bash "$root/scripts/ucx-wheel.sh")"

# KVLINK_BENCH_TABLE_ONLY=1: only print the table of the JSON files already in <out>.
if [[ "${KVLINK_BENCH_TABLE_ONLY:-0}" != 1 ]]; then
echo "bench-ucx: UCX 1.13 (system)" >&2
env -u KVLINK_UCX_ROOT CARGO_TARGET_DIR="$target" \
    cargo run --quiet --locked --release -p kvlink-bench -- --no-progress \
    --json "$out/ucx113.json" "${args[@]}" >&2
echo "bench-ucx: UCX 1.22 ($ucx122_root)" >&2
KVLINK_UCX_ROOT="$ucx122_root" CARGO_TARGET_DIR="${KVLINK_UCX122_TARGET_DIR:-$target-ucx122}" \
    cargo run --quiet --locked --release -p kvlink-bench -- --no-progress \
    --json "$out/ucx122.json" "${args[@]}" >&2
fi

python3 - "$out/ucx113.json" "$out/ucx122.json" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]

def size(n):
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"

def g(x, fmt):
    return "" if x is None else fmt.format(x)

def index(run):
    rows = {}
    for r in run["rows"]:
        rows[(r["transport"], r["kind"], r["size"], r["in_flight"])] = r
    return rows

idx = [index(r) for r in runs]
keys = []
for r in runs[0]["rows"] + runs[1]["rows"]:
    k = (r["transport"], r["size"], r["in_flight"])
    if r["kind"].startswith("kvlink") and k not in keys:
        keys.append(k)
import re
vers = []
for r in runs:
    kv = r["host"].get("kvlink_ucx", "?")
    pt = re.search(r"[0-9]+\.[0-9]+\.[0-9]+", r["host"].get("ucx") or "")
    pt = pt.group(0) if pt else "?"
    if pt != kv:
        sys.exit(f"kvlink ran on UCX {kv} but ucx_perftest on {pt}: the ratios would mix generations")
    vers.append(kv)
print(f"| tl | size | in flight | UCX {vers[0]}: tag_bw GB/s | kvlink transport | kvlink request | "
      f"UCX {vers[1]}: tag_bw GB/s | kvlink transport | kvlink request |")
print("|---|---|---|---|---|---|---|---|---|")
for tl, sz, n in keys:
    cells = []
    for rows in idx:
        bw = rows.get((tl, "ucx_tag_bw", sz, 1)) if n == 1 else None
        tr = rows.get((tl, "kvlink_transport", sz, n))
        rq = rows.get((tl, "kvlink_request", sz, n))
        cells += [g(bw and bw["gbps"], "{:.2f}"),
                  g(tr and tr["x_tag_bw"], "{:.2f}x"),
                  g(rq and rq["x_tag_bw"], "{:.2f}x") or g(rq and rq["gbps"], "{:.2f} GB/s")]
    print(f"| {tl} | {size(sz)} | {n} | " + " | ".join(cells) + " |")
PY
