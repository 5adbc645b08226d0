#!/usr/bin/env bash
# Bandwidth of kvlink between two processes on loopback next to raw `ucx_perftest -t tag_bw -O 1`
# on the same transport, as ratios. Noisy on a 2-core machine: use --iters 100 or more and
# compare rows of the same run, not runs. Arguments go to kvlink-bench (see src/bin/kvlink-bench.rs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
cd "$root"
exec cargo run --locked --release --bin kvlink-bench -- "$@"
