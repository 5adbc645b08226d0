#!/usr/bin/env python3
"""The README's speed table from kvlink-bench JSON runs (`--json runN.json`).

One run on a small shared machine swings by 2-5x in single cells, so each cell is the median of
that cell over the runs given. Rows a run did not measure are left out, and so are rows whose
status is not "ok": a kvlink row with failed requests still carries figures, taken over the rounds
that completed (the slow or stuck ones dropped), which would flatter it. How many were left out is
printed at the end.

Over tcp it also counts the rows the kernel paced (JSON `pacing_kicks`, kvlink-bench's
`pacing.rs`: under BBR a connection that runs into its pacing rate is a third slower at 16 MiB,
`ucx_perftest`'s as kvlink's, and which connections do is chance), and beside each tcp target the
median over the runs where neither its kvlink row nor its baseline was paced: the same network
behaviour on both sides of the ratio.

    python3 scripts/bench-table.py run1.json run2.json run3.json
"""
import json
import statistics
import sys

K, M = 4096, 1 << 20
# As kvlink-bench's `pacing::PACED`: from this many pacing-timer kicks on, a row was paced.
PACED = 1000
SIZES = [(K, "4 KiB"), (M, "1 MiB"), (16 * M, "16 MiB"), (64 * M, "64 MiB")]


def usable(r):
    """Whether a row's figures go into a cell: its status is "ok" (rows written before the field
    existed count as ok)."""
    return r.get("status", "ok") == "ok"


def left_out(runs):
    """`transport kind size in_flight: status` of each row that `usable` refuses, over the runs."""
    return [
        f"{r['transport']} {r['kind']} {r['size']} x{r['in_flight']}: {r.get('status')}"
        for run in runs
        for r in run["rows"]
        if not usable(r)
    ]


def main(paths):
    if not paths:
        sys.exit(__doc__)
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    gaps = {r["settings"].get("gap_us", 0) for r in runs}
    if len(gaps) > 1:
        sys.exit(f"runs with different --gap-us ({sorted(gaps)}) do not go in one table")

    def cell(tl, kind, size, n, field):
        vals = [
            r[field]
            for run in runs
            for r in run["rows"]
            if (r["transport"], r["kind"], r["size"], r["in_flight"]) == (tl, kind, size, n)
            and r.get(field) is not None
            and usable(r)
        ]
        return statistics.median(vals) if vals else None

    def g3(x):
        if x is None:
            return "-"
        if x >= 1000:
            return "%d" % round(x, -len(str(int(x))) + 3)
        if x >= 100:
            return "%.0f" % x
        if x >= 10:
            return "%.1f" % x
        return "%.2f" % x

    def ratio(x, unit="x", digits=2):
        return "-" if x is None else f"%.{digits}f{unit}" % x

    gap = gaps.pop()
    if gap:
        print(f"Whole-request rows {gap} us apart (--gap-us {gap}), median of {len(runs)} runs.\n")
    print(
        "| tl | size | in flight | tag_bw GB/s | transport | request | µs/request p50 | x tag_lat "
        "| tag_bw -O N GB/s | request x tag_bw -O N |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tl in ["tcp", "sm"]:
        for size, label in SIZES:
            us = cell(tl, "kvlink_request", size, 1, "us_p50")
            tr = cell(tl, "kvlink_transport", size, 1, "x_tag_bw")
            if us is None and tr is None:
                continue
            bw = cell(tl, "ucx_tag_bw", size, 1, "gbps")
            rq = cell(tl, "kvlink_request", size, 1, "x_tag_bw")
            xl = cell(tl, "kvlink_request", size, 1, "x_tag_lat")
            print(
                f"| {tl} | {label} | 1 | {g3(bw)} | {ratio(tr)} | {ratio(rq)} | {g3(us)} "
                f"| {ratio(xl, digits=1)} | | |"
            )
            if size == K:
                ns = [n for n in (64, 1024, 4096) if cell(tl, "kvlink_request", K, n, "us_p50")]
                if ns:
                    req = " / ".join(ratio(cell(tl, "kvlink_request", K, n, "x_tag_bw")) for n in ns)
                    us = " / ".join(g3(cell(tl, "kvlink_request", K, n, "us_p50")) for n in ns)
                    xl = " / ".join(
                        ratio(cell(tl, "kvlink_request", K, n, "x_tag_lat"), digits=1) for n in ns
                    )
                    label_n = " / ".join(str(n) for n in ns)
                    print(f"| {tl} | 4 KiB | {label_n} | | | {req} | {us} | {xl} | | |")
            if size == M and cell(tl, "kvlink_request", M, 8, "us_p50") is not None:
                print(
                    f"| {tl} | 1 MiB | 8 | | | {ratio(cell(tl, 'kvlink_request', M, 8, 'x_tag_bw'))} "
                    f"| {g3(cell(tl, 'kvlink_request', M, 8, 'us_p50'))} | "
                    f"| {g3(cell(tl, 'ucx_tag_bw', M, 8, 'gbps'))} "
                    f"| {ratio(cell(tl, 'kvlink_request', M, 8, 'x_tag_bw_n'))} |"
                )


    targets(runs)
    pacing(runs)
    out = left_out(runs)
    if out:
        print(f"\nLeft out, status not ok ({len(out)} rows): " + "; ".join(out))


def paced(r):
    """True or False where the row counted its pacing-timer kicks, None where it did not."""
    k = r.get("pacing_kicks")
    return None if k is None else k >= PACED


def find(run, tl, kind, size, n):
    return next(
        (r for r in run["rows"] if (r["transport"], r["kind"], r["size"], r["in_flight"]) == (tl, kind, size, n)),
        None,
    )


def pacing(runs):
    """How many runs' tcp rows the kernel paced, per size and kind, where the runs counted it."""
    lines = []
    for size, label in SIZES[1:]:
        cells = []
        for kind, name in [("ucx_tag_bw", "tag_bw"), ("kvlink_transport", "transport"),
                           ("kvlink_request", "request")]:
            marks = [paced(r) for run in runs if (r := find(run, "tcp", kind, size, 1)) is not None]
            marks = [m for m in marks if m is not None]
            if marks:
                cells.append(f"{name} {sum(marks)}/{len(marks)}")
        if cells:
            lines.append(f"- {label}: " + ", ".join(cells))
    if lines:
        print(f"\ntcp rows the kernel paced ({PACED} pacing-timer kicks or more), runs of all:\n")
        print("\n".join(lines))


def quartiles(vals):
    """Median and the middle half (25th-75th percentile) of `vals`; under four values, the
    median and the whole range."""
    if len(vals) < 4:
        return statistics.median(vals), min(vals), max(vals)
    q = statistics.quantiles(vals, n=4)
    return q[1], q[0], q[2]


def targets(runs):
    """Issue 8's speed targets, each as the median over the runs of its per-run figure, with the
    middle half of the runs beside it (one run's cell swings far more than the median)."""

    def per_run(tl, kind, size, n, field):
        out = []
        for run in runs:
            for r in run["rows"]:
                if (r["transport"], r["kind"], r["size"], r["in_flight"]) == (tl, kind, size, n):
                    if r.get(field) is not None and usable(r):
                        out.append(r[field])
        return out

    def scale_ratio(tl):
        # us per request with 4096 in flight over that with 64, within each run.
        out = []
        for run in runs:
            us = {
                r["in_flight"]: r["us_p50"]
                for r in run["rows"]
                if (r["transport"], r["kind"], r["size"]) == (tl, "kvlink_request", K)
                and r.get("us_p50")
                and usable(r)
            }
            if 64 in us and 4096 in us:
                out.append(us[4096] / us[64])
        return out

    def unpaced(tl, kind, size):
        # The per-run ratio where both the kvlink row and its baseline counted no pacing.
        out = []
        for run in runs:
            r, base = find(run, tl, kind, size, 1), find(run, tl, "ucx_tag_bw", size, 1)
            if r and base and usable(r) and r.get("x_tag_bw") is not None:
                if paced(r) is False and paced(base) is False:
                    out.append(r["x_tag_bw"])
        return out

    checks = []
    for tl in ["tcp", "sm"]:
        for size, label in SIZES[1:]:
            checks.append((f"{tl} transport {label} x tag_bw", ">=", 0.95,
                           per_run(tl, "kvlink_transport", size, 1, "x_tag_bw"),
                           unpaced(tl, "kvlink_transport", size)))
        for size, label in SIZES[1:]:
            want = 0.8 if size == M else 0.9
            checks.append((f"{tl} request {label} x tag_bw", ">=", want,
                           per_run(tl, "kvlink_request", size, 1, "x_tag_bw"),
                           unpaced(tl, "kvlink_request", size)))
        checks.append((f"{tl} request 1 MiB x 8 x tag_bw", ">=", 0.95,
                       per_run(tl, "kvlink_request", M, 8, "x_tag_bw")))
        checks.append((f"{tl} request 4 KiB x tag_lat", "<=", 6.0,
                       per_run(tl, "kvlink_request", K, 1, "x_tag_lat")))
        checks.append((f"{tl} 4 KiB us/request 4096 over 64 in flight", "<=", 1.5,
                       scale_ratio(tl)))
    print(f"\nIssue 8 targets: median of {len(runs)} runs (middle half of the runs in brackets)\n")
    report(checks)
    # Raw UCX with as many sends outstanding as the row keeps requests in flight (the issue
    # sets the in-flight row against -O 1; this is beside it, not instead).
    same_n = [(f"{tl} request 1 MiB x 8 x tag_bw -O 8", ">=", 0.95,
               per_run(tl, "kvlink_request", M, 8, "x_tag_bw_n")) for tl in ["tcp", "sm"]]
    if any(vals for _, _, _, vals in same_n):
        print("\nBeside them, the in-flight row against `tag_bw -O 8`:\n")
        report(same_n)


def report(checks):
    for name, op, want, vals, *rest in checks:
        if not vals:
            continue
        med, lo, hi = quartiles(vals)
        met = med >= want if op == ">=" else med <= want
        line = f"- {name} {op} {want}: {med:.2f} ({lo:.2f}-{hi:.2f}) {'met' if met else 'not met'}"
        calm = rest[0] if rest else []
        if calm and len(calm) < len(vals):
            # Only where some run was paced: else it repeats the figure.
            m, _, _ = quartiles(calm)
            line += f"; neither side paced: {m:.2f} over {len(calm)} of the {len(vals)} runs"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
