# Sourced by scripts/test-all.sh and scripts/package-check.sh: run named steps, keep going after
# a failure, and print one summary table at the end.
#
#   step NAME [requires=PREV_NAME] -- COMMAND...   runs COMMAND (skipped if PREV_NAME failed)
#   finish LABEL [HEADER]                          prints the table; exits 1 if any step failed
names=() results=() times=()
failed=0
declare -A ok=()

step() {
    local name="$1"; shift
    local requires=""
    if [[ "$1" == requires=* ]]; then requires="${1#requires=}"; shift; fi
    [[ "$1" == "--" ]] && shift
    names+=("$name")
    if [[ -n "$requires" && "${ok[$requires]:-0}" != 1 ]]; then
        results+=("SKIP (needs $requires)"); times+=("-"); failed=1
        return 0
    fi
    echo
    echo "=== $name: $*"
    local t0=$SECONDS
    if "$@"; then
        results+=("ok"); ok[$name]=1
    else
        results+=("FAIL"); failed=1
    fi
    times+=("$((SECONDS - t0))s")
}

finish() {
    local label="$1" header="${2:-summary}"
    echo
    echo "=== $header"
    local i
    for i in "${!names[@]}"; do
        printf '  %-16s %-24s %s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}"
    done
    if [[ $failed -ne 0 ]]; then
        echo "$label: FAILED"
        exit 1
    fi
    echo "$label: all checks passed"
}
