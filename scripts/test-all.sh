#!/usr/bin/env bash
# Runs every check kvlink has, in one go, and prints a summary. Exits non-zero if any fails.
#   install-deps, cargo fmt --check, cargo clippy (workspace: library and bench, all targets,
#   -D warnings), the fuzz targets' clippy on stable, the API docs of the two library crates
#   (cargo doc, -D warnings), cargo test (workspace), the timeline
#   feature's test, bench-table.py's unit tests, CMake configure + build (Ninja) + ctest, the
#   package check (Release line, all-off install, installed consumer), header drift check,
#   AddressSanitizer run, bounded fuzz run, and the same crate against a second UCX generation
#   (ucx122: the PyPI wheel's UCX 1.22).
# Rust is compiled once: CMake's cargo step uses the same target dir and profile (dev) as
# `cargo test`, so it only links. Later steps still run after a failure, so one run shows all
# problems; a step whose prerequisite failed is reported as skipped.
#
# Environment: CARGO_TARGET_DIR (default <repo>/target), KVLINK_BUILD_DIR (default
# <repo>/build-ci), KVLINK_SKIP_DEPS=1 to skip installing dependencies, KVLINK_UCX_ROOT to run
# every step against that UCX instead of the system one (the ucx122 step is then skipped),
# KVLINK_UCX122_TARGET_DIR for the ucx122 step's cargo target dir (default CARGO_TARGET_DIR
# with -ucx122 appended).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
build_dir="${KVLINK_BUILD_DIR:-$root/build-ci}"
jobs="$(nproc 2>/dev/null || echo 2)"

bash "$root/scripts/install-deps.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

# shellcheck source=scripts/steps.sh
source "$root/scripts/steps.sh"
# shellcheck source=scripts/beside.sh
source "$root/scripts/beside.sh"

# The fuzz targets are a workspace of their own (fuzz/), which `--all` does not reach.
step fmt -- bash -c "cargo fmt --all -- --check && cargo fmt --manifest-path '$root/fuzz/Cargo.toml' -- --check"
step clippy -- cargo clippy --locked --workspace --all-targets -- -D warnings
# The fuzz targets are their own crate (fuzz/, outside the workspace), built by the fuzz step
# near the end and only with nightly: checked here on stable too, so a change to the core's API
# that breaks a target shows in the first minutes (about 30 s cold, sharing the target dir).
step fuzz-check -- cargo clippy --manifest-path "$root/fuzz/Cargo.toml" --all-targets -- -D warnings
# The API docs of the two library crates, broken or private links an error (a few seconds: the
# dependencies were checked by the clippy step).
step docs -- env RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps -p kvlink-proto -p kvlink
# Every test of the workspace, built first; the shared-memory wedge suite, which mostly waits
# (100 of the step's 420 s of tests here, 7 s of CPU), runs beside the others
# (scripts/beside.sh). engine_faults, which also mostly waits, does not: beside the engine
# suites (engine_storms' spinning threads, engine_stress) a fresh pair's first 128 MiB request
# between its two processes twice missed its 4 s deadline in one CI run (2026-12-07), where
# alone it takes about 50 ms.
beside_suites=(sm_kill_wedge)
# The other suites: the main lane names --workspace, as the build does (cargo unifies the
# dependencies' features over the packages it selects: `-p kvlink`, or the suite alone,
# would be a build of their own). The suites are the integration-test targets the build
# reports, so a new one runs without a change here.
cargo_test_rest() {
    local rc=0 t sel=()
    for t in "$@"; do
        [[ " ${beside_suites[*]} " == *" $t "* ]] || sel+=(--test "$t")
    done
    cargo test --locked --no-fail-fast --workspace --lib --bins "${sel[@]}" || rc=1
    return $rc
}
# The beside suites, run as cargo runs a test binary (from its package's directory), from the
# executables of the same build.
run_suites() {
    local rc=0 name exe dir
    while IFS=$'\t' read -r name exe dir; do
        [[ " ${beside_suites[*]} " == *" $name "* ]] || continue
        echo "     Running tests/$name.rs ($exe)"
        (cd "$dir" && "$exe") || {
            rc=1
            echo "error: test failed, to rerun pass \`--test $name\`"
        }
    done <"$1"
    return $rc
}
cargo_test() {
    local built list rc=0
    built="$(mktemp)" list="$(mktemp)"
    if ! cargo test --locked --workspace --no-run --message-format=json-render-diagnostics >"$built"; then
        rm -f "$built" "$list"
        return 1
    fi
    # name, executable, package directory of each integration-test target
    python3 -c '
import json, os, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if j.get("reason") == "compiler-artifact" and j["target"]["kind"] == ["test"]:
        print(j["target"]["name"], j["executable"], os.path.dirname(j["manifest_path"]), sep="\t")' \
        "$built" >"$list" || rc=1
    if [[ $rc -eq 0 && ! -s $list ]]; then
        # The workspace has integration tests: none found means this script misread the build.
        echo "cargo-test: the build reported no integration-test targets" >&2
        rc=1
    fi
    # The doc tests before the lanes: they compile the libraries once more (without the
    # bench's features), which the waiting suites should not have beside them.
    cargo test --locked --no-fail-fast --workspace --doc || rc=1
    if [[ -s $list ]]; then
        local suites=()
        mapfile -t suites < <(cut -f1 "$list")
        beside cargo_test_rest "${suites[@]}" ::: run_suites "$list" || rc=1
    fi
    rm -f "$built" "$list"
    return $rc
}
step cargo-test -- cargo_test
# The stage timeline (src/timeline.rs) records only with its feature, off in every other build:
# its recording test runs here, so the feature's code is built and checked in CI.
step timeline -- cargo test --locked --lib --features timeline timeline::
# The README table's script: medians over runs, rows whose status is not ok left out.
step bench-table -- python3 "$root/scripts/test_bench_table.py"
step cmake-configure -- cmake -S "$root" -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=Debug -DKVLINK_BUILD_TESTS=ON \
    -DKVLINK_CARGO_TARGET_DIR="$CARGO_TARGET_DIR" -DKVLINK_UCX_ROOT="${KVLINK_UCX_ROOT:-}"
step cmake-build requires=cmake-configure -- cmake --build "$build_dir" -j "$jobs"
# --repeat until-pass:2: a case that fails is run once more, and both runs are printed. A net
# for UCX 1.13's async-thread crash in ucp_cm_server_conn_request_cb (a listener destroyed while
# it serves a connection request). Its trigger in kvlink, a peer redialling an agent that is
# shutting down, is fixed (the listener now closes first; 0 in 150 runs, was 16 in 150), but
# UCX's race itself remains. Not a net for timing: no kvlink test is retried for being slow.
step ctest requires=cmake-build -- ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --repeat until-pass:2
# The package as the README documents it: the Release CMake line + ctest, an install with every
# option off, and a consumer built against that install alone.
step package-check -- env KVLINK_SKIP_DEPS=1 bash "$root/scripts/package-check.sh"
step header-drift -- bash "$root/scripts/check-header-drift.sh"
# The docs name what the code has: cited paths and tests, KVLINK_* variables, metrics, CMake
# options (a fraction of a second; it reads tracked files only).
step docs-check -- python3 "$root/scripts/check-docs.py"
# AddressSanitizer (nightly) over the transport, engine, two-process and C++ suites, with UCX's
# memory hooks off; and a bounded fuzz run of the wire decoder, the handshake and the TensorRT-LLM
# wrapper's request-info decoder (C++, clang's libFuzzer). Each prints SKIP where nightly (or
# cargo-fuzz), or clang's libFuzzer runtime, is missing.
step sanitize -- bash "$root/scripts/sanitize.sh"
step fuzz -- env KVLINK_FUZZ_SECONDS="${KVLINK_FUZZ_SECONDS:-45}" bash "$root/scripts/fuzz.sh"

# A second UCX generation: the PyPI wheel's UCX 1.22 (scripts/ucx-wheel.sh installs it in a
# virtual environment) next to Debian's 1.13, with its own CMake build dir and its own cargo
# target dir unless KVLINK_UCX122_TARGET_DIR names one (.ci/run names the main one: then only
# kvlink and its test binaries compile once more, not its dependencies). Suites, chosen to stay
# within about 6 minutes here: the library's unit tests (the UCX resource and transport checks), the
# transport in one process and between two processes (tcp, sm, auto, an explicit list), the
# engine in one process, the engine between two processes under real faults (engine_faults),
# the stuck shared-memory queue (sm_kill_wedge), crossing dials (crossing_dials), listen
# addresses (listen_addresses), and the C++ suite's cases that depend on the UCX linked (the
# UCX checks, the API's version and UCX, the demo, the wrapper, the installed and
# add_subdirectory consumers). The C++ suite's 102 `Transports/` cases (the C++ surface over
# tcp and sm) are left out here: they drive the same Rust engine that the suites above run on
# this UCX, and took 65 of this ctest's 100 s in CI (the ctest step above runs them on the
# system UCX, the sanitize step under ASan).
ucx122() (
    local ucx_root
    ucx_root="$(bash "$root/scripts/ucx-wheel.sh")" || return 1
    export KVLINK_UCX_ROOT="$ucx_root"
    export CARGO_TARGET_DIR="${KVLINK_UCX122_TARGET_DIR:-$CARGO_TARGET_DIR-ucx122}"
    local dir="${build_dir}-ucx122" rc=0
    echo "ucx122: KVLINK_UCX_ROOT=$KVLINK_UCX_ROOT CARGO_TARGET_DIR=$CARGO_TARGET_DIR build dir $dir"
    # listen_addresses has a case only this UCX runs (a listener restarted at its port: 1.13
    # takes no SO_REUSEADDR and skips it).
    # The wedge suite runs 4 rounds here, not 8 (about a minute less): this step checks that the
    # second UCX generation behaves the same (2 of them odd rounds, its tcp-listening survivor);
    # the cargo-test step above gives the 8-round figure.
    # engine_faults' requests get 10 s, not 4 (KVLINK_FAULTS_TIMEOUT_MS): with this UCX, a 128 MiB
    # request between two network namespaces took 3.3 s in a slow CI hour, and the one after a
    # healed partition missed 4 s with every byte landed. The deadline checks are unchanged.
    export KVLINK_FAULTS_TIMEOUT_MS="${KVLINK_FAULTS_TIMEOUT_MS:-10000}"
    export WEDGE_ITERS="${WEDGE_ITERS:-4}"
    # A test that fails here runs once more on its own, and both runs are printed (as ctest's
    # until-pass:2 below and in the ctest step). Added for engine_faults' frozen sender over
    # UCX 1.22's shared memory, about 1 run in 25, which turned out to be the sender's crash: its
    # stopped send handed the buffer back before UCX let go of it (fixed on 2026-12-06,
    # docs/RELIABILITY.md, "Known gaps"). Kept as a net for the less-travelled UCX; a rerun is
    # printed, so it is seen. The cargo-test step above, on the system UCX, has no such net.
    # The two suites that mostly wait (engine_faults: 99 s here with its 10 s requests,
    # sm_kill_wedge: 72 s) run beside the others, as in the cargo-test step.
    local log reruns sel
    local first=(--lib --test transport_local --test transport_two_process --test engine
        --test crossing_dials --test listen_addresses)
    local second=(--test engine_faults --test sm_kill_wedge)
    log="$(mktemp)"
    if ! { cargo test --locked --no-run "${first[@]}" "${second[@]}" &&
        beside cargo test --locked --no-fail-fast "${first[@]}" \
            ::: cargo test --locked --no-fail-fast "${second[@]}"; } 2>&1 | tee "$log"; then
        if reruns="$(python3 "$root/scripts/failed-tests.py" "$log")"; then
            while read -r sel; do
                echo "ucx122: RERUN of what failed: cargo test $sel"
                # shellcheck disable=SC2086 # $sel is a list of cargo's arguments
                cargo test --locked $sel || rc=1
            done <<<"$reruns"
        else
            rc=1
        fi
    fi
    rm -f "$log"
    if cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKVLINK_BUILD_TESTS=ON \
        -DKVLINK_CARGO_TARGET_DIR="$CARGO_TARGET_DIR" -DKVLINK_UCX_ROOT="$KVLINK_UCX_ROOT" &&
        cmake --build "$dir" -j "$jobs"; then
        ctest --test-dir "$dir" --output-on-failure -j "$jobs" --repeat until-pass:2 \
            -E '^kvlink\.Transports/' || rc=1
    else
        rc=1
    fi
    return $rc
)
if [[ -n "${KVLINK_UCX_ROOT:-}" ]]; then
    echo "ucx122: skipped, every step above ran against KVLINK_UCX_ROOT=$KVLINK_UCX_ROOT"
else
    step ucx122 -- ucx122
fi

finish test-all
