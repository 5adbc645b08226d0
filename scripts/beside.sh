# Sourced by scripts/test-all.sh and scripts/sanitize.sh: run two commands at once.
#
#   beside FIRST... ::: SECOND...
#
# FIRST runs in the foreground, its output as it comes; SECOND runs at the same time with its
# output kept in a file, printed under a header once both have ended (so the log reads as if
# they had run one after the other, and scripts/failed-tests.py parses it the same way).
# Returns 1 if either failed. Either may be a shell function.
#
# What it is for: test suites that mostly wait (sm_kill_wedge: 100 s here for 7 s of CPU, the
# probe's rounds; engine_faults in the ucx122 step, with its 10 s requests: deadlines of frozen
# and partitioned peers) run beside the suites that work, instead of after them. Both sets were built before (`cargo test
# --no-run`), so the two cargo commands only run binaries (cargo holds its build lock while it
# builds, not while tests run).
# Stops `pid` and every process below it (the test binaries and the peers they spawn).
beside_kill_tree() {
    local child
    for child in $(pgrep -P "$1" 2>/dev/null); do
        beside_kill_tree "$child"
    done
    kill -TERM "$1" 2>/dev/null || true
}

beside() {
    local first=() second=() seen=0 a
    for a in "$@"; do
        if [[ $seen == 0 && $a == ::: ]]; then
            seen=1
        elif [[ $seen == 0 ]]; then
            first+=("$a")
        else
            second+=("$a")
        fi
    done
    if [[ ${#first[@]} -eq 0 || ${#second[@]} -eq 0 ]]; then
        echo "beside: usage: beside FIRST... ::: SECOND..." >&2
        return 2
    fi
    local out pid rc1=0 rc2=0
    out="$(mktemp)"
    "${second[@]}" >"$out" 2>&1 &
    pid=$!
    # A background command ignores SIGINT in a script: an interrupted run stops it here, with
    # everything it started.
    trap 'beside_kill_tree "$pid"; rm -f "$out"; exit 130' INT TERM
    "${first[@]}" || rc1=$?
    wait "$pid" || rc2=$?
    trap - INT TERM
    echo
    echo "=== beside: ${second[*]} (ran at the same time as the above; status $rc2)"
    cat "$out"
    rm -f "$out"
    [[ $rc1 -eq 0 && $rc2 -eq 0 ]]
}
