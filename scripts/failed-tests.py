#!/usr/bin/env python3
"""Reads the output of `cargo test --no-fail-fast` and prints, one per line, the cargo
arguments that run again only what failed: `--test NAME -- --exact T1 T2 ...` for a test binary
whose failed tests are listed, `--test NAME` alone for one that ended without its list (it
crashed), `--lib ...` likewise for the library's unit tests. Prints nothing, and exits 1, when
the output shows no failed binary (a build error, say): there is nothing to run again.

Used by scripts/test-all.sh (the ucx122 step). Usage: failed-tests.py LOG
"""
import re
import sys


def selector(running):
    """`--test NAME` or `--lib` for a `Running ...` line, or None."""
    m = re.search(r"Running tests/([A-Za-z0-9_]+)\.rs", running)
    if m:
        return ["--test", m.group(1)]
    if re.search(r"Running unittests src/lib\.rs", running):
        return ["--lib"]
    return None


def parse(text):
    failed_bins = set()
    for m in re.finditer(r"to rerun pass `(--test [A-Za-z0-9_]+|--lib)`", text):
        failed_bins.add(tuple(m.group(1).split()))
    names = {}
    current = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if "Running " in line:
            sel = selector(line)
            current = tuple(sel) if sel else None
        elif line.strip() == "failures:" and current is not None:
            # The second `failures:` block of a binary lists the names, 4 spaces in.
            j = i + 1
            listed = []
            while j < len(lines) and re.fullmatch(r"    \S+", lines[j]):
                listed.append(lines[j].strip())
                j += 1
            if listed:
                names.setdefault(current, []).extend(listed)
            i = j
            continue
        i += 1
    out = []
    for b in sorted(failed_bins):
        listed = names.get(b, [])
        out.append(list(b) + (["--", "--exact"] + listed if listed else []))
    return out


def main():
    with open(sys.argv[1], errors="replace") as f:
        text = f.read()
    runs = parse(text)
    for r in runs:
        print(" ".join(r))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
