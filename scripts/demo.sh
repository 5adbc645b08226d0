#!/usr/bin/env bash
# The main job: installs what it needs (Debian 12), then runs the kvlink demo. Arguments are
# passed to the demo program.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-deps.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
cd "$root"
# TODO(demo): the `kvlink-demo` binary (src/bin/kvlink-demo.rs) is being written separately; it
# must grow into the two-process loopback transfer as the transfer engine lands.
exec cargo run --locked --release --bin kvlink-demo -- "$@"
