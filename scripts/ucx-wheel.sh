#!/usr/bin/env bash
# Installs UCX 1.22 from PyPI (the wheel libucx-cu12==1.22.0: libraries, headers, pkg-config and
# CMake files, ucx_info and ucx_perftest; configured --with-cuda --enable-mt, no verbs/rdmacm) into
# a virtual environment, and prints its UCX prefix: the value for KVLINK_UCX_ROOT. Nothing happens
# when it is there already (a file test). CI builds and tests kvlink against it as a second UCX
# generation next to Debian's 1.13 (scripts/test-all.sh, step ucx122).
#
#   KVLINK_UCX_VENV   where the virtual environment goes (default ~/.cache/kvlink/ucx-1.22)
#
# The wheel's CUDA modules (lib/ucx/libuct_cuda.so, libucm_cuda.so) link libcuda.so.1; UCX loads
# them with dlopen and, without a driver, leaves them out (ucx_info -d shows no cuda transport),
# so the core libraries work on a machine without a GPU. Its ucx_perftest has no rpath to lib/:
# run it with LD_LIBRARY_PATH=<prefix>/lib.
set -euo pipefail

version=1.22.0
venv="${KVLINK_UCX_VENV:-${HOME}/.cache/kvlink/ucx-1.22}"
python="$venv/bin/python3"

find_prefix() {
    [[ -x "$python" ]] || return 1
    "$python" - <<'PY'
import os, sys
import libucx
root = os.path.dirname(libucx.__file__)
ok = os.path.isfile(os.path.join(root, "include/ucp/api/ucp.h")) and \
     os.path.exists(os.path.join(root, "lib/libucp.so"))
print(root) if ok else sys.exit(1)
PY
}

if prefix="$(find_prefix 2>/dev/null)" && [[ "$("$python" -c 'import libucx; print(libucx.__version__)' 2>/dev/null)" == "$version" ]]; then
    echo "$prefix"
    exit 0
fi

echo "ucx-wheel: installing libucx-cu12==$version into $venv" >&2
if ! python3 -m venv "$venv" >&2 2>/dev/null; then
    # Debian's python3 needs python3-venv for ensurepip.
    if [[ $(id -u) -eq 0 ]]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-venv >&2
    else
        echo "ucx-wheel: python3 -m venv failed; install python3-venv" >&2
        exit 1
    fi
    rm -rf "$venv"   # what the failed attempt left (a venv without pip)
    python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check "libucx-cu12==$version" >&2
if ! prefix="$(find_prefix)"; then
    echo "ucx-wheel: libucx-cu12 $version installed but has no include/ucp/api/ucp.h or lib/libucp.so" >&2
    exit 1
fi
echo "$prefix"
