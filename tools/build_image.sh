#!/usr/bin/env bash
# The service image (docker/Dockerfile) with podman, for amd64 and arm64, from Debian bases made
# by mmdebstrap (no container registry needed); arm64 builds under qemu-user-static (binfmt_misc).
#
#   tools/build_image.sh                                  # both: a manifest list and one image each
#   tools/build_image.sh --arch amd64 --tag localhost/whistle-stream:test    # one image
#
# With several architectures, TAG is a manifest list of TAG-amd64 and TAG-arm64 (`podman manifest
# push TAG docker://REGISTRY/whistle-stream` publishes both). Built with --format docker, which
# keeps the HEALTHCHECK (the OCI format has none). The host's CA bundle reaches pip in the build
# as /run/secrets/ca.crt, never a layer. Bases are kept in podman's store
# (localhost/debian-ARCH:bookworm-slim); WARM=0 in the environment skips compiling the kernels in.
# The arm64 build compiles them under emulation: about 12 CPU-minutes more.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCHES=amd64,arm64
TAG=localhost/whistle-stream:latest
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) ARCHES=$2; shift 2 ;;
        --tag) TAG=$2; shift 2 ;;
        *) echo "usage: $0 [--arch amd64,arm64] [--tag TAG]" >&2; exit 2 ;;
    esac
done
CACHE=${WHISTLE_IMAGE_CACHE:-/var/cache/whistle-stream/image}
mkdir -p "$CACHE"
# Settings that work on hosts without systemd or a writable cgroup v2 (docs/deploy.md)
if [ -z "${CONTAINERS_CONF:-}" ]; then
    export CONTAINERS_CONF=$CACHE/containers.conf
    printf '[containers]\ndefault_ulimits = ["nproc=4096:4096", "nofile=20000:20000"]\nnetns = "host"\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' >"$CONTAINERS_CONF"
fi
START=$(date +%s)
say() { echo "[image $(( $(date +%s) - START )) s] $*"; }

CA=""
for f in "${PIP_CERT:-}" /etc/ssl/certs/ca-certificates.crt; do [ -n "$f" ] && [ -f "$f" ] && { CA=$f; break; }; done
IFS=, read -r -a arches <<<"$ARCHES"
for arch in "${arches[@]}"; do
    case "$arch" in amd64|arm64) ;; *) echo "$0: --arch takes amd64 and arm64, got $arch" >&2; exit 2 ;; esac
    if [ "$arch" = arm64 ] && [ "$(uname -m)" != aarch64 ] && [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
        update-binfmts --enable qemu-aarch64 || { echo "$0: arm64 needs qemu-user-static and binfmt-support" >&2; exit 1; }
    fi
done

for arch in "${arches[@]}"; do
    base=localhost/debian-$arch:bookworm-slim
    if ! podman image exists "$base"; then
        say "making the $arch base (mmdebstrap --arch=$arch)"
        mmdebstrap --arch="$arch" --variant=minbase bookworm "$CACHE/rootfs-$arch.tar" >"$CACHE/mmdebstrap-$arch.log" 2>&1
        podman import --arch "$arch" "$CACHE/rootfs-$arch.tar" "$base" >/dev/null
        rm -f "$CACHE/rootfs-$arch.tar"
    fi
    out=$TAG
    [ ${#arches[@]} -gt 1 ] && out=$TAG-$arch
    say "building $out for linux/$arch"
    podman build --format docker --platform "linux/$arch" --build-arg BASE="$base" --build-arg WARM="${WARM:-1}" \
        ${CA:+--volume "$CA:/run/secrets/ca.crt:ro"} \
        -f docker/Dockerfile --ignorefile docker/Dockerfile.dockerignore -t "$out" .
    say "built $out: $(podman image inspect "$out" --format '{{.Architecture}}, {{.Size}} bytes')"
done
if [ ${#arches[@]} -gt 1 ]; then
    # whatever TAG names now, a list or a plain image, it is replaced
    podman manifest rm "$TAG" >/dev/null 2>&1 || podman rmi "$TAG" >/dev/null 2>&1 || true
    podman manifest create "$TAG" >/dev/null
    for arch in "${arches[@]}"; do podman manifest add "$TAG" "containers-storage:$TAG-$arch" >/dev/null; done
    say "manifest list $TAG: ${arches[*]}"
fi
