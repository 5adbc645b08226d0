#!/usr/bin/env python3
"""Lines up the stage marks of a generation and a context process (kvlink's `timeline` feature,
one request in flight) and prints where a request's time goes, stage by stage.

usage: timeline.py GEN_DUMP CTX_DUMP

Each dump holds `nanoseconds stage` lines (CLOCK_MONOTONIC, one clock for both processes). A
request is the span from one `AdvertiseCalled` of the generation side to the next. Within it the
script follows the path below, taking each stage's first mark after the previous stage's; a span
where a stage is missing (a warm-up or the end) is left out. Per stage it prints the median
and the quartiles of the time since the previous stage, its 90th percentile and its mean (the
bench's GB/s is a mean: a stage whose mean stands far above its median holds the row's tail), and
the same of the whole path; the
stages off the path (the receive's post, the send's completion, the calls' returns) are given
as medians from the span's start.
"""
import statistics
import sys

PATH = [
    ("gen", "AdvertiseCalled", "advertise called"),
    ("gen", "AdvertiseSent", "Advertise handed to UCX"),
    ("ctx", "ControlArrived", "it arrives (UCX callback)"),
    ("ctx", "ControlHandled", "core has handled it"),
    ("ctx", "AdvertisementTaken", "next_advertisement returns it"),
    ("ctx", "AcceptReturned", "accept returns"),
    ("ctx", "SendPosted", "data send handed to UCX"),
    ("gen", "DataLanded", "data lands (UCX callback)"),
    ("gen", "SinkEntered", "the pass calls the engine's sink"),
    ("gen", "LandingHandled", "core has handled the landing"),
    ("gen", "TimersHandled", "... the other events and due timers"),
    ("gen", "SinkFlushed", "sink has flushed (verdict queued, lease back)"),
    ("gen", "ControlSent", "the verdict handed to UCX (tcp: sendmsg)"),
    ("gen", "WaitReturned", "wait returns Completed"),
]
ASIDE = [
    ("gen", "RecvPosted"),
    ("gen", "AdvertiseReturned"),
    ("gen", "WaitCalled"),
    ("ctx", "SendDone"),
    ("ctx", "SendReturned"),
]


def load(path, side):
    with open(path) as f:
        for line in f:
            t, stage = line.split()
            yield int(t), side, stage


def spread(v):
    """p25, p50, p75, p90 and the mean of `v`."""
    v = sorted(v)
    at = lambda q: v[min(len(v) - 1, int(q * len(v)))]
    return at(0.25), statistics.median(v), at(0.75), at(0.9), statistics.fmean(v)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    marks = sorted(list(load(sys.argv[1], "gen")) + list(load(sys.argv[2], "ctx")))
    starts = [i for i, m in enumerate(marks) if m[1:] == ("gen", "AdvertiseCalled")]
    steps = [[] for _ in PATH[1:]]
    aside = {a: [] for a in ASIDE}
    totals = []
    for a, b in zip(starts, starts[1:]):
        t0 = marks[a][0]
        k, prev, got = a, t0, []
        for side, stage, _ in PATH[1:]:
            while k < b and marks[k][1:] != (side, stage):
                k += 1
            if k >= b:
                break
            got.append(marks[k][0] - prev)
            prev = marks[k][0]
        if len(got) < len(PATH) - 1:
            continue
        for s, d in zip(steps, got):
            s.append(d)
        totals.append(prev - t0)
        for key in ASIDE:
            t = next((m[0] for m in marks[a:b] if m[1:] == key), None)
            if t is not None:
                aside[key].append(t - t0)
    if not totals:
        sys.exit("no complete request in the dumps (one request in flight, both sides marked?)")
    print(f"{len(totals)} requests of {len(starts) - 1} complete; us from the previous stage")
    cols = ("p25", "p50", "p75", "p90", "mean")
    print(f"  {'side':4} {'stage':19} " + " ".join(f"{c:>6}" for c in cols))
    for (side, stage, what), v in zip(PATH[1:], steps):
        row = " ".join(f"{x / 1000:6.2f}" for x in spread(v))
        print(f"  {side:4} {stage:19} {row}  {what}")
    row = ", ".join(f"{c} {x / 1000:.2f}" for c, x in zip(cols, spread(totals)))
    print(f"  path, advertise called to wait returned: {row} us")
    print("  off the path, p50 us from advertise called:")
    for (side, stage), v in aside.items():
        if v:
            print(f"    {side:4} {stage:19} {statistics.median(v) / 1000:6.2f}")


if __name__ == "__main__":
    main()
