#!/usr/bin/env bash
# The figures of docs/RELIABILITY.md, from the real-fault suites: runs them one test at a time
# with their output, then prints one row per scenario (the `== ...` header each test prints):
# the outcomes seen, the worst end past the deadline, buffers still leased after a request
# (leaks), and requests whose bytes did not check out (wrong data).
#
#   bash scripts/reliability.sh            # tcp and shared memory; the netns rows need root
#
# Honours CARGO_TARGET_DIR. Prints the raw log's path at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log="${KVLINK_RELIABILITY_LOG:-$(mktemp /tmp/kvlink-reliability.XXXXXX)}"

cargo test --locked --test engine_faults --test netns --test trust --test engine_storms \
    --test transport_two_process --test fan_in \
    -- --nocapture --test-threads=1 >"$log" 2>&1 || {
    echo "reliability: a suite failed; see $log" >&2
    grep -E "^test .*FAILED|panicked" "$log" >&2 || true
    exit 1
}

python3 - "$log" <<'EOF'
import re, sys
rows, cur = [], None
for line in open(sys.argv[1], errors="replace"):
    line = line.rstrip("\n")
    h = re.search(r"(?:^|\.\.\. )== (.*)$", line)
    if h:
        cur = {"name": h.group(1), "ends": {}, "late": [], "leased": 0, "wrong": 0}
        rows.append(cur)
        continue
    if line.strip() in ("ok", "FAILED") or line.startswith(("test ", "running ")):
        cur = None
    if cur is None:
        continue
    if "late_ms=" in line or re.search(r"\b(STORM|POOL)\b", line):
        e = re.search(r"\bend=(\S+)", line)
        if e:
            cur["ends"][e.group(1)] = cur["ends"].get(e.group(1), 0) + 1
        l = re.search(r"late_ms=(-?[0-9.]+)", line)
        if l and e and e.group(1) != "Completed":
            cur["late"].append(float(l.group(1)))
        if re.search(r"\bleased=([1-9][0-9]*)", line):
            cur["leased"] += 1
        # Wrong data: a request that says Completed and whose bytes do not check out.
        if e and e.group(1) == "Completed" and "verified=false" in line:
            cur["wrong"] += 1
        w = re.search(r"\bwrong=([0-9]+)", line)
        if w:
            cur["wrong"] += int(w.group(1))
        for k in ("completed", "cancelled"):
            n = re.search(rf"\b{k}=([0-9]+)", line)
            if n and "STORM" in line:
                key = k.capitalize()
                cur["ends"][key] = cur["ends"].get(key, 0) + int(n.group(1))
print(f"{'scenario':<58} {'ends seen (both sides)':<44} {'worst vs deadline':>17} {'leaks':>5} {'wrong':>5}")
for r in rows:
    ends = ", ".join(f"{k} x{v}" for k, v in sorted(r["ends"].items())) or "-"
    worst = f"{max(r['late']):+.1f} ms" if r["late"] else "-"
    print(f"{r['name'][:58]:<58} {ends[:44]:<44} {worst:>17} {r['leased']:>5} {r['wrong']:>5}")
EOF
echo
echo "transport-level figures (netns, transport_two_process):"
grep -E "^(partition|10% loss)|TimedOut after|PeerLost after|: outcomes" "$log" | sed 's/^/  /' || true
echo "reliability: raw output in $log"
