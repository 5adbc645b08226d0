#!/usr/bin/env python3
"""Unit tests of scripts/bench-table.py: `python3 scripts/test_bench_table.py`."""
import contextlib
import importlib.util
import io
import json
import os
import tempfile
import unittest

_spec = importlib.util.spec_from_file_location(
    "bench_table", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-table.py")
)
bench_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_table)

M = 1 << 20


def row(tl, kind, size, n, status="ok", **fields):
    r = {"transport": tl, "kind": kind, "size": size, "in_flight": n, "status": status}
    r.update(fields)
    return r


def run(*rows):
    return {"settings": {"gap_us": 0}, "rows": list(rows)}


class LeftOut(unittest.TestCase):
    def table(self, runs):
        paths = []
        with tempfile.TemporaryDirectory() as d:
            for i, r in enumerate(runs):
                p = os.path.join(d, f"run{i}.json")
                with open(p, "w") as f:
                    json.dump(r, f)
                paths.append(p)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                bench_table.main(paths)
        return out.getvalue()

    def test_a_failed_kvlink_row_does_not_go_into_a_median_or_a_target(self):
        # Three runs; the third's row had failed requests and, over the rounds that completed,
        # a flattering figure. It must not lift the median (0.70, not 0.80) nor meet the target.
        runs = [
            run(
                row("tcp", "ucx_tag_bw", M, 1, gbps=6.0),
                row("tcp", "kvlink_request", M, 1, x_tag_bw=x, us_p50=us),
            )
            for x, us in [(0.6, 200.0), (0.7, 190.0)]
        ]
        runs.append(
            run(
                row("tcp", "ucx_tag_bw", M, 1, gbps=6.0),
                row("tcp", "kvlink_request", M, 1, "failed", x_tag_bw=2.0, us_p50=50.0),
            )
        )
        out = self.table(runs)
        self.assertIn("| tcp | 1 MiB | 1 | 6.00 | - | 0.65x | 195 |", out)
        self.assertIn("- tcp request 1 MiB x tag_bw >= 0.8: 0.65 (0.60-0.70) not met", out)
        self.assertIn("Left out, status not ok (1 rows): tcp kvlink_request 1048576 x1: failed", out)

    def test_rows_without_a_status_count_as_ok(self):
        r = row("sm", "kvlink_request", M, 1, x_tag_bw=0.9)
        del r["status"]
        self.assertTrue(bench_table.usable(r))
        self.assertFalse(bench_table.usable(row("sm", "kvlink_request", M, 1, "error")))

    def test_paced_rows_are_counted_and_the_unpaced_runs_get_a_figure_of_their_own(self):
        # Four runs at 16 MiB: in two the kvlink row was paced (slow), in one the baseline was.
        S = 16 * M
        spec = [(0.95, 3, 2), (0.62, 3000, 4), (0.64, 4000, 1500), (0.97, 0, 0)]
        runs = [
            run(
                row("tcp", "ucx_tag_bw", S, 1, gbps=8.0, pacing_kicks=b),
                row("tcp", "kvlink_transport", S, 1, x_tag_bw=x, pacing_kicks=k),
            )
            for x, k, b in spec
        ]
        out = self.table(runs)
        self.assertIn("- 16 MiB: tag_bw 1/4, transport 2/4", out)
        # All four: median 0.79 (of 0.795), not met; the two runs where neither was paced: 0.96.
        self.assertIn(
            "- tcp transport 16 MiB x tag_bw >= 0.95: 0.79 (0.62-0.97) not met; "
            "neither side paced: 0.96 over 2 of the 4 runs",
            out,
        )

    def test_runs_that_did_not_count_pacing_get_no_pacing_lines(self):
        runs = [run(row("tcp", "ucx_tag_bw", M, 1, gbps=6.0),
                    row("tcp", "kvlink_transport", M, 1, x_tag_bw=0.9))]
        out = self.table(runs)
        self.assertNotIn("paced", out)


if __name__ == "__main__":
    unittest.main()
