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
    --test transport_two_process \
    -- --nocapture --test-threads=1 >"$log" 2>&1 || {
    echo "reliability: a suite failed; see $log" >&2
    grep -E "^test .*FAILED|panicked" "$log" >&2 || true
    exit 1
}

python3 - "$log" <<'EOF'
import re, sys
rows, cur = [], None
def row(name):
    r = {"name": name, "ends": {}, "late": [], "leased": 0, "wrong": 0, "lines": 0}
    rows.append(r)
    return r
for line in open(sys.argv[1], errors="replace"):
    line = line.rstrip("\n")
    m = re.match(r"^(?:running|test) .*", line)
    h = re.match(r"^== (.*)", line)
    if h:
        cur = row(h.group(1))
        continue
    if cur is None:
        continue
    if "late_ms=" in line or re.search(r"\b(RESULT|STORM|POOL)\b", line):
        cur["lines"] += 1
        e = re.search(r"\bend=(\S+)", line)
        if e:
            cur["ends"][e.group(1)] = cur["ends"].get(e.group(1), 0) + 1
        l = re.search(r"late_ms=(-?[0-9.]+)", line)
        if l and e and e.group(1) != "Completed":
            cur["late"].append(float(l.group(1)))
        if re.search(r"\bleased=([1-9][0-9]*)", line):
            cur["leased"] += 1
        if "verified=false" in line:
            cur["wrong"] += 1
        w = re.search(r"\bwrong=([0-9]+)", line)
        if w:
            cur["wrong"] += int(w.group(1))
        for k in ("completed", "cancelled"):
            n = re.search(rf"\b{k}=([0-9]+)", line)
            if n and "STORM" in line:
                key = k.capitalize()
                cur["ends"][key] = cur["ends"].get(key, 0) + int(n.group(1))
    if line.startswith("test ") and (" ... ok" in line or " ... FAILED" in line):
        cur = None
print(f"{'scenario':<62} {'ends':<34} {'worst past deadline':>20} {'leaks':>5} {'wrong data':>10}")
for r in rows:
    ends = ", ".join(f"{k} x{v}" for k, v in sorted(r["ends"].items())) or "-"
    worst = f"{max(r['late']):+.1f} ms" if r["late"] else "-"
    print(f"{r['name'][:62]:<62} {ends[:34]:<34} {worst:>20} {r['leased']:>5} {r['wrong']:>10}")
EOF
echo
echo "transport-level figures (netns, transport_two_process):"
grep -E "^(partition|10% loss)|TimedOut after|PeerLost after|: outcomes" "$log" | sed 's/^/  /' || true
echo "reliability: raw output in $log"
