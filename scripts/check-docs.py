#!/usr/bin/env python3
"""Mechanical checks that the docs name what the code has. Reads files only; no build.

  python3 scripts/check-docs.py        # exits 1 and lists each mismatch, 0 when none

What it checks (README.md, docs/*.md, docs/trtllm/README.md and the public C++ headers):
- every repository path they cite exists (`tests/x.rs`, `src/engine/glue.rs`, ...);
- every test they cite as `<suite>` `<test name>` (or a `<test name prefix>_...`) is a test
  function of that suite's file;
- every KVLINK_* environment variable the library, the binaries or the TensorRT-LLM wrapper
  read at run time is named in the docs, and every KVLINK_* name in the docs is in the code;
- every metric src/metrics.rs registers is in the README's metrics table, and the reverse;
- every CMake option and cache variable kvlink defines is named in the README.
"""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
FILES = subprocess.check_output(["git", "ls-files"], text=True).split()
DOCS = ["README.md", *sorted(glob.glob("docs/*.md")), "docs/trtllm/README.md"]
HEADERS = sorted(glob.glob("include/kvlink/*.hpp")) + ["include/kvlink/trtllm_adapter.h"]
TOP = ("src", "tests", "scripts", "docs", "cmake", "include", "kvlink-proto", "bench",
       "wrapper", "cpp_tests", "examples", "fuzz")
problems = []


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def code_text(globs):
    """The tracked files that match `globs`, read (`**` crosses folders)."""
    res = [re.compile(re.escape(g).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*") + "$")
           for g in globs]
    return "\n".join(read(f) for f in FILES if any(r.match(f) for r in res)
                     and os.path.isfile(f))


docs_text = {p: read(p) for p in DOCS + HEADERS}
all_docs = "\n".join(docs_text.values())

# Paths. A trailing `_*` or `*` is a family of files (`kvlink-proto/tests/proto_*.rs`).
path_re = re.compile(r"(?<![\w/.-])((?:%s)/[\w./*-]*[\w*])" % "|".join(map(re.escape, TOP)))
for doc, text in docs_text.items():
    for m in sorted(set(path_re.findall(text))):
        if "*" in m:
            if not glob.glob(m):
                problems.append(f"{doc}: no file matches {m}")
        elif not os.path.exists(m) and not any(f.startswith(m + "/") for f in FILES):
            # Paths inside other projects (UCX's src/uct/..., TensorRT-LLM's include/...).
            if not re.search(r"/(uct|tensorrt_llm)/", m):
                problems.append(f"{doc}: cites {m}, which does not exist")

# Tests cited as `suite` `name` or `tests/suite.rs` `name...`.
suites = {os.path.basename(f)[:-3]: f for f in FILES if re.search(r"(^|/)tests/[\w]+\.rs$", f)}
pair_re = re.compile(r"`(?:[\w-]+/)*(?:tests/)?(\w+?)(?:\.rs)?`:? `([a-z]\w+?)(?:_?\.\.\.)?`")
for doc, text in docs_text.items():
    for suite, name in pair_re.findall(text):
        if suite in suites and not re.search(r"\bfn %s" % re.escape(name), read(suites[suite])):
            problems.append(f"{doc}: `{suite}` has no test `{name}`")

# Environment variables read at run time.
rust = code_text(["src/**/*.rs", "bench/src/**/*.rs"])
read_re = re.compile(
    r'(?:var_os|var|env_micros|getenv|envOr\([^,]*,)\s*\(?\s*"(KVLINK_[A-Z0-9_]+)"'
    r'|const \w+: &str = "(KVLINK_[A-Z0-9_]+)"')
runtime = {a or b for a, b in read_re.findall(rust + code_text(["wrapper/*.cpp"]))}
runtime = {v for v in runtime if not v.startswith("KVLINK_TEST_")}
for v in sorted(runtime):
    if not re.search(r"\b%s\b" % v, all_docs):
        problems.append(f"{v} is read by the code and named in no doc")
code_all = code_text(["src/**/*.rs", "bench/**/*.rs", "kvlink-proto/**/*.rs", "tests/**/*.rs",
                      "wrapper/*", "scripts/*", "cmake/*", "CMakeLists.txt", "cpp_tests/**/*",
                      "build.rs", ".ci/run", "examples/*", "include/kvlink/*.h"])
for v in sorted(set(re.findall(r"\bKVLINK_[A-Z0-9_]*[A-Z0-9]\b", all_docs))):
    if not re.search(r"\b%s\b" % v, code_all):
        problems.append(f"{v} is named in the docs and appears nowhere in the code")

# Metrics: the registered names; the text adds `_total` to counters and the unit
# (`_seconds`, `_bytes`) to those registered with one.
registered = set(re.findall(r'register(?:_with_unit)?\(\s*"(\w+)"', read("src/metrics.rs")))
readme = docs_text["README.md"]
table = readme[readme.index("## Metrics"):]
table = table[:table.index("\n\n", table.index("| Name |"))]
in_table = set()
for name in re.findall(r"`kvlink_(\w+)(?:\{[^}]*\})?`", table):
    name = re.sub(r"_total$", "", name)
    in_table.add(name if name in registered else re.sub(r"_(seconds|bytes)$", "", name))
for name in sorted(registered - in_table):
    problems.append(f"metric kvlink_{name} is registered and not in the README's table")
for name in sorted(in_table - registered):
    problems.append(f"metric kvlink_{name} is in the README's table and not registered")

# CMake options and cache variables.
cmake = code_text(["CMakeLists.txt", "cmake/*.cmake"])
cached = set(re.findall(r"option\((KVLINK_\w+)", cmake))
cached |= {n for n, kind in re.findall(r"set\((KVLINK_\w+) [^)]*CACHE (\w+)", cmake)
           if kind != "INTERNAL"}
cached |= set(re.findall(r"find_program\((KVLINK_\w+)", cmake))
for v in sorted(cached):
    if not re.search(r"`%s`" % v, readme):
        problems.append(f"CMake variable {v} is not in the README")

for p in problems:
    print(p)
print(f"check-docs: {len(problems)} problem(s)", file=sys.stderr)
sys.exit(1 if problems else 0)
