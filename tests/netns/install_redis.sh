#!/bin/sh
# Idempotent: make sure a real `redis-server` binary is available for the namespace tests.
#
# - Does nothing when redis-server is already on PATH (or in /usr/bin).
# - Runs `apt-get update` only when apt does not know the package yet (no candidate),
#   or when the first install attempt fails because the lists are stale.
# - Stops the Debian package from starting its own system service during install
#   (a temporary policy-rc.d that returns 101), so no daemon is left listening on
#   127.0.0.1:6379; the tests start their own redis-server processes.
#
# Usage: sh tests/netns/install_redis.sh        (needs root, or sudo when not root)
set -eu

if command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]; then
    echo "install_redis: redis-server already present: $(command -v redis-server || echo /usr/bin/redis-server)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "install_redis: not root and no sudo; cannot install redis-server" >&2
        exit 1
    fi
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_redis: apt-get not found; install redis-server (>= 6) by other means" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Wait for another apt/dpkg run (e.g. a parallel CI step) instead of failing on the lock.
LOCK="-o DPkg::Lock::Timeout=600"

# Keep the package's init script / systemd unit from starting a server during install.
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    $SUDO sh -c "printf '#!/bin/sh\nexit 101\n' > $POLICY && chmod 755 $POLICY"
    CREATED_POLICY=1
fi
cleanup() {
    if [ "$CREATED_POLICY" = "1" ]; then
        $SUDO rm -f "$POLICY"
    fi
}
trap cleanup EXIT INT TERM

candidate() {
    apt-cache policy redis-server 2>/dev/null | awk '/Candidate:/ {print $2}'
}

C="$(candidate)"
if [ -z "$C" ] || [ "$C" = "(none)" ]; then
    echo "install_redis: package lists do not know redis-server; running apt-get update"
    $SUDO apt-get $LOCK update -q
fi

if ! $SUDO apt-get $LOCK install -y -q --no-install-recommends redis-server; then
    echo "install_redis: install failed; refreshing package lists and retrying"
    $SUDO apt-get $LOCK update -q
    $SUDO apt-get $LOCK install -y -q --no-install-recommends redis-server
fi

# In case a service manager started it anyway (policy-rc.d not honoured), stop it.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
elif [ -x /etc/init.d/redis-server ]; then
    $SUDO /etc/init.d/redis-server stop >/dev/null 2>&1 || true
fi

echo "install_redis: installed $(redis-server --version)"
