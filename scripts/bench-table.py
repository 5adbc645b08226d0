#!/usr/bin/env python3
"""The README's speed table from kvlink-bench JSON runs (`--json runN.json`).

One run on a small shared machine swings by 2-5x in single cells, so each cell is the median of
that cell over the runs given. Rows a run did not measure are left out.

    python3 scripts/bench-table.py run1.json run2.json run3.json
"""
import json
import statistics
import sys

K, M = 4096, 1 << 20
SIZES = [(K, "4 KiB"), (M, "1 MiB"), (16 * M, "16 MiB"), (64 * M, "64 MiB")]


def main(paths):
    if not paths:
        sys.exit(__doc__)
    runs = [json.load(open(p)) for p in paths]
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
    print("| tl | size | in flight | tag_bw GB/s | transport | request | µs/request p50 | x tag_lat |")
    print("|---|---|---|---|---|---|---|---|")
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
                f"| {ratio(xl, digits=1)} |"
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
                    print(f"| {tl} | 4 KiB | {label_n} | | | {req} | {us} | {xl} |")
            if size == M and cell(tl, "kvlink_request", M, 8, "us_p50") is not None:
                print(
                    f"| {tl} | 1 MiB | 8 | | | {ratio(cell(tl, 'kvlink_request', M, 8, 'x_tag_bw'))} "
                    f"| {g3(cell(tl, 'kvlink_request', M, 8, 'us_p50'))} | |"
                )


if __name__ == "__main__":
    main(sys.argv[1:])
