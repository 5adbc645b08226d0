#!/usr/bin/env bash
# The main job: installs what it needs (Debian 12), then runs the kvlink demo. Arguments are
# passed to the demo program.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
cd "$root"
# kvlink-demo (src/bin/kvlink-demo.rs): a context process and a generation process on loopback
# hand over a KV-cache-shaped request, then a request whose data a fault hook drops ends TimedOut
# at its deadline on both sides, and the same processes serve a third request.
# Options: --transport tcp|sm (default tcp), --timeout-ms N (default 2000).
exec cargo run --locked --release --bin kvlink-demo -- "$@"
