# Shared by tools/build_image.sh and tools/build_addon.sh (sourced, not run): podman settings that
# work on hosts without systemd or a writable cgroup v2 (docs/deploy.md), the host's CA bundle for
# pip inside a build (as /run/secrets/ca.crt, never a layer), qemu for arm64, and the Debian bases
# made by mmdebstrap and kept in podman's store (localhost/debian-ARCH:bookworm-slim).
CACHE=${WHISTLE_IMAGE_CACHE:-/var/cache/whistle-stream/image}
mkdir -p "$CACHE"
if [ -z "${CONTAINERS_CONF:-}" ]; then
    export CONTAINERS_CONF=$CACHE/containers.conf
    printf '[containers]\ndefault_ulimits = ["nproc=4096:4096", "nofile=20000:20000"]\nnetns = "host"\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' >"$CONTAINERS_CONF"
fi
START=$(date +%s)
say() { echo "[image $(( $(date +%s) - START )) s] $*"; }

CA=""
for f in "${PIP_CERT:-}" /etc/ssl/certs/ca-certificates.crt; do [ -n "$f" ] && [ -f "$f" ] && { CA=$f; break; }; done

# check_arch ARCH: amd64 or arm64, with qemu-user-static registered for arm64 on another machine
check_arch() {
    case "$1" in amd64|arm64) ;; *) echo "$0: --arch takes amd64 and arm64, got $1" >&2; exit 2 ;; esac
    if [ "$1" = arm64 ] && [ "$(uname -m)" != aarch64 ] && [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
        update-binfmts --enable qemu-aarch64 || { echo "$0: arm64 needs qemu-user-static and binfmt-support" >&2; exit 1; }
    fi
}

# debian_base ARCH: prints the base image's name, made once by mmdebstrap
debian_base() {
    local base=localhost/debian-$1:bookworm-slim
    if ! podman image exists "$base"; then
        say "making the $1 base (mmdebstrap --arch=$1)" >&2
        mmdebstrap --arch="$1" --variant=minbase bookworm "$CACHE/rootfs-$1.tar" >"$CACHE/mmdebstrap-$1.log" 2>&1
        podman import --arch "$1" "$CACHE/rootfs-$1.tar" "$base" >/dev/null
        rm -f "$CACHE/rootfs-$1.tar"
    fi
    echo "$base"
}
