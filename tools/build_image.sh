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
source tools/image_base.sh
IFS=, read -r -a arches <<<"$ARCHES"
for arch in "${arches[@]}"; do check_arch "$arch"; done

for arch in "${arches[@]}"; do
    base=$(debian_base "$arch")
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
