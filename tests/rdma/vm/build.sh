#!/usr/bin/env bash
# Prepare the soft-RoCE VM: host tools, a Debian 6.1 kernel with the modules it
# needs, busybox-static, and an initramfs. Idempotent; everything goes into
# $MEMSEM_VM_CACHE (default tests/rdma/.cache). Prints "KERNEL INITRD".
#
# Environment:
#   MEMSEM_VM_CACHE       cache dir (default: <this dir>/../.cache)
#   MEMSEM_VM_KERNEL_PKG  kernel package (default: what linux-image-amd64 depends on;
#                         an already cached kernel is reused without asking apt)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MEMSEM_VM_CACHE:-$here/../.cache}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)

# Modules to load; dependencies are added from modules.dep.
# rdma_rxe allocates the "crc32" crypto hash (ICRC) at link creation; without a
# crc32 module it fails with ENOENT ("rdma_rxe: failed to add d0").
want_modules=(virtio_pci 9pnet_virtio 9p ib_core ib_uverbs udp_tunnel ip6_udp_tunnel
              crc32_generic crc32-pclmul rdma_rxe dummy)

say() { echo "memsem-vm: $*" >&2; }

apt_install() {
    if [ "$(id -u)" != 0 ]; then
        say "missing $*; install as root: apt-get install -y --no-install-recommends $*"
        exit 2
    fi
    say "installing $*"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "$@" >&2 \
        || { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "$@" >&2; }
}

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v cpio >/dev/null || need+=(cpio)
command -v depmod >/dev/null || need+=(kmod)
# Run inside the chroot (= the host root): ip, rdma.
command -v rdma >/dev/null || need+=(iproute2)
[ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"

apt_download() {  # apt_download PKG DESTDIR -> path of the .deb
    local dir
    dir=$(mktemp -d "$cache/dl.XXXXXX")
    chmod 755 "$dir"
    if ! (cd "$dir" && apt-get -o APT::Sandbox::User=root download -qq "$1" >&2); then
        (apt-get update -qq >&2 && cd "$dir" && apt-get -o APT::Sandbox::User=root download -qq "$1" >&2)
    fi
    ls "$dir"/*.deb
}

# --- busybox ---------------------------------------------------------------
if [ ! -x "$cache/busybox" ]; then
    deb=$(apt_download busybox-static)
    x=$(mktemp -d "$cache/x.XXXXXX")
    dpkg-deb -x "$deb" "$x"
    cp "$x/bin/busybox" "$cache/busybox.tmp" && mv "$cache/busybox.tmp" "$cache/busybox"
    rm -rf "$x" "$(dirname "$deb")"
fi

# --- kernel + the module closure -------------------------------------------
kdir="$cache/kernel"
if [ "$(sed -n 2p "$kdir/ok" 2>/dev/null)" != "${want_modules[*]}" ]; then
    pkg=${MEMSEM_VM_KERNEL_PKG:-}
    if [ -z "$pkg" ]; then
        pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
        if [ -z "$pkg" ]; then
            apt-get update -qq >&2
            pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
        fi
    fi
    [ -n "$pkg" ] || { say "cannot resolve the kernel package"; exit 2; }
    say "fetching $pkg"
    deb=$(apt_download "$pkg")
    x=$(mktemp -d "$cache/x.XXXXXX")
    dpkg-deb -x "$deb" "$x"
    kver=$(ls "$x/lib/modules" | head -n1)
    depmod -b "$x" "$kver"
    rm -rf "$kdir" "$kdir.tmp"
    mkdir -p "$kdir.tmp/modules"
    cp "$x/boot/vmlinuz-$kver" "$kdir.tmp/vmlinuz"
    # Resolve load order (dependencies first) from modules.dep.
    declare -A dep=() path=() seen=()
    while IFS=: read -r p d; do
        n=${p##*/}; n=${n%%.ko*}
        path[$n]=$p; dep[$n]=$d
    done <"$x/lib/modules/$kver/modules.dep"
    order=()
    visit() {
        local m=$1 d
        [ -n "${seen[$m]:-}" ] && return
        seen[$m]=1
        [ -n "${path[$m]:-}" ] || { say "module $m not in $pkg (built in?)"; return; }
        for d in ${dep[$m]}; do d=${d##*/}; visit "${d%%.ko*}"; done
        order+=("$m")
    }
    for m in "${want_modules[@]}"; do visit "$m"; done
    : >"$kdir.tmp/modules.load"
    for m in "${order[@]}"; do
        f=${path[$m]##*/}
        case $f in
            *.ko) cp "$x/lib/modules/$kver/${path[$m]}" "$kdir.tmp/modules/$f" ;;
            *.ko.xz) xz -dc "$x/lib/modules/$kver/${path[$m]}" >"$kdir.tmp/modules/${f%.xz}"; f=${f%.xz} ;;
            *.ko.zst) zstd -qdc "$x/lib/modules/$kver/${path[$m]}" >"$kdir.tmp/modules/${f%.zst}"; f=${f%.zst} ;;
            *) say "unsupported module file $f"; exit 2 ;;
        esac
        echo "$f" >>"$kdir.tmp/modules.load"
    done
    printf '%s %s\n%s\n' "$pkg" "$kver" "${want_modules[*]}" >"$kdir.tmp/ok"
    mv "$kdir.tmp" "$kdir"
    rm -rf "$x" "$(dirname "$deb")"
fi

# --- initramfs (cheap: rebuilt when init or the module set changed) --------
initrd="$cache/initrd.cpio"
stamp=$(cat "$here/init" "$kdir/modules.load" "$kdir/ok" | md5sum | cut -d' ' -f1)
if [ ! -f "$initrd" ] || [ "$(cat "$initrd.stamp" 2>/dev/null)" != "$stamp" ]; then
    r=$(mktemp -d "$cache/root.XXXXXX")
    mkdir -p "$r/bin" "$r/proc" "$r/sys" "$r/dev" "$r/modules"
    cp "$cache/busybox" "$r/bin/busybox"
    cp "$here/init" "$r/init"
    chmod 755 "$r/init" "$r/bin/busybox"
    cp "$kdir/modules/"*.ko "$r/modules/"
    cp "$kdir/modules.load" "$r/modules.load"
    (cd "$r" && find . -print0 | cpio --null -o -H newc --quiet) >"$initrd.tmp"
    mv "$initrd.tmp" "$initrd"
    echo "$stamp" >"$initrd.stamp"
    rm -rf "$r"
fi

echo "$kdir/vmlinuz $initrd"
