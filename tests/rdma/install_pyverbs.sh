#!/usr/bin/env bash
# Make pyverbs importable from a Python 3.11 virtualenv, idempotently.
#
#   tests/rdma/install_pyverbs.sh VENV
#
# Uses Debian 12's python3-pyverbs (rdma-core 44, built for CPython 3.11):
# installs it plus libibverbs1, ibverbs-providers (rxe provider), rdma-core and
# iproute2 (the `rdma` tool) with apt when missing (needs root), then symlinks
# only the `pyverbs` package folder into VENV's site-packages (no .pth onto
# /usr/lib/python3/dist-packages: that would expose every Debian package).
# The pyverbs extension modules link libpython3.11.so.1.0; with a shared-libpython
# interpreter (pyenv, Debian) the already loaded one is reused.
# Exit status 0 when `import pyverbs.device` works from VENV afterwards.
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 VENV" >&2; exit 2; }
venv=$1
py="$venv/bin/python"
[ -x "$py" ] || { echo "install_pyverbs: $py not found" >&2; exit 2; }

ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$ver" != 3.11 ]; then
    echo "install_pyverbs: Debian's pyverbs is built for CPython 3.11; $py is $ver" >&2
    exit 2
fi

pkgs=(python3-pyverbs libibverbs1 ibverbs-providers rdma-core iproute2)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "install_pyverbs: run as root or: apt-get install -y --no-install-recommends ${missing[*]}" >&2
        exit 2
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
        || { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; }
fi

src=/usr/lib/python3/dist-packages/pyverbs
[ -d "$src" ] || { echo "install_pyverbs: $src missing after install" >&2; exit 2; }
site=$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
dst="$site/pyverbs"
if [ "$(readlink "$dst" 2>/dev/null || true)" != "$src" ]; then
    [ -e "$dst" ] && [ ! -L "$dst" ] && { echo "install_pyverbs: $dst exists and is not our link" >&2; exit 2; }
    ln -sfn "$src" "$dst"
fi
"$py" -c 'import pyverbs.device, pyverbs.mr, pyverbs.qp, pyverbs.cq' \
    || { echo "install_pyverbs: import pyverbs failed from $py" >&2; exit 1; }
echo "install_pyverbs: $dst -> $src"
