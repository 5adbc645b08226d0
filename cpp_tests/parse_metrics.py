#!/usr/bin/env python3
"""Checks the C++ demo's metrics file (`kvlink_demo --metrics-file PATH`) with a real Prometheus
text parser, prometheus_client's: every documented metric is there, with its type, and the
generation side shows the demo's 2 completed and 1 timed-out requests.

    python3 cpp_tests/parse_metrics.py PATH

Exits non-zero, loudly, when prometheus_client is missing: scripts/install-deps.sh installs it.
"""
import sys

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as e:
    sys.exit(
        f"parse_metrics: FAIL: cannot import prometheus_client ({e}); "
        "install it with `python3 -m pip install prometheus_client` (scripts/install-deps.sh does)"
    )

# Sample name -> the family type the parser must report.
EXPECTED = {
    "kvlink_requests_total": "counter",
    "kvlink_request_duration_seconds_count": "histogram",
    "kvlink_request_duration_seconds_bucket": "histogram",
    "kvlink_transfer_bytes_total": "counter",
    "kvlink_ops_in_flight": "gauge",
    "kvlink_buffers_leased": "gauge",
    "kvlink_buffers_fenced": "gauge",
    "kvlink_health_state": "gauge",
    "kvlink_stale_frames_total": "counter",
    "kvlink_bad_frames_total": "counter",
    "kvlink_unknown_frames_total": "counter",
    "kvlink_duplicate_frames_total": "counter",
    "kvlink_control_resends_total": "counter",
    "kvlink_peer_failures_total": "counter",
    "kvlink_reconnects_total": "counter",
}


def main(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    samples = []  # (name, labels, value, family type)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.append((s.name, s.labels, s.value, family.type))
    failures = []
    for name, typ in EXPECTED.items():
        types = {t for n, _, _, t in samples if n == name}
        if types != {typ}:
            failures.append(f"{name}: expected one {typ} family, found {sorted(types) or 'none'}")

    def requests(outcome, role=None):
        return sum(
            v
            for n, labels, v, _ in samples
            if n == "kvlink_requests_total"
            and labels.get("outcome") == outcome
            and (role is None or labels.get("role") == role)
        )

    for outcome, want in [("completed", 2), ("timed_out", 1), ("cancelled", 0), ("peer_lost", 0), ("rejected", 0)]:
        got = requests(outcome)
        if got != want:
            failures.append(f'kvlink_requests_total{{outcome="{outcome}"}}: {got}, expected {want}')
    if requests("completed", "receiver") != 2 or requests("timed_out", "receiver") != 1:
        failures.append("the generation side's requests must be counted with role=receiver")
    count = [v for n, l, v, _ in samples if n == "kvlink_request_duration_seconds_count" and l.get("role") == "receiver"]
    if count != [3]:
        failures.append(f"kvlink_request_duration_seconds_count{{role=receiver}}: {count}, expected [3]")
    leased = [v for n, _, v, _ in samples if n == "kvlink_buffers_leased"]
    if leased != [0]:
        failures.append(f"kvlink_buffers_leased: {leased}, expected [0]")
    moved = [v for n, _, v, _ in samples if n == "kvlink_transfer_bytes_total"]
    if not moved or moved[0] < 2 * 8 * (1 << 20):
        failures.append(f"kvlink_transfer_bytes_total: {moved}, expected at least two requests' 8 MiB")
    if failures:
        print(text)
        for f in failures:
            print("parse_metrics: FAIL:", f)
        return 1
    print(f"parse_metrics: OK: {len(samples)} samples parsed; generation side: 2 completed, 1 timed_out")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: parse_metrics.py METRICS_FILE")
    sys.exit(main(sys.argv[1]))
