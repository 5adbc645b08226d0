#!/usr/bin/env bash
# kvlink between two processes on loopback next to raw `ucx_perftest` (tag_bw -O 1 and tag_lat)
# on the same transport, as ratios: the transport row, whole requests one at a time, and the
# in-flight sweep. Noisy on a 2-core machine: use the default counts (or more) and compare rows
# of the same run, not runs. Arguments go to kvlink-bench (bench/, `--help` explains each), e.g.
#   bash scripts/bench.sh --quick                                  # smoke run, under a minute
#   bash scripts/bench.sh --json bench.json --csv bench.csv --plot bench.png
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
cd "$root"
exec cargo run --locked --release -p kvlink-bench -- "$@"
