#!/usr/bin/env bash
# Fails when the checked-in headers under include/ differ from what the current src/bridge.rs
# and the locked cxx version generate. Fix a failure with: bash scripts/gen-header.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

bash "$root/scripts/gen-header.sh" "$tmp" >/dev/null

status=0
for h in kvlink/bridge.h rust/cxx.h; do
    if [[ ! -f "$root/include/$h" ]]; then
        echo "header drift: include/$h is missing (run scripts/gen-header.sh)" >&2
        status=1
    elif ! diff -u "$root/include/$h" "$tmp/$h"; then
        echo "header drift: include/$h differs from the generated one (run scripts/gen-header.sh)" >&2
        status=1
    fi
done
[[ $status -eq 0 ]] && echo "header drift: none (include/kvlink/bridge.h, include/rust/cxx.h)"
exit $status
