#!/usr/bin/env bash
# The Home Assistant add-on's image (addon/), built as the Supervisor builds it (addon/ is the whole
# build context, BUILD_FROM a Debian base), with podman and no registry: the base made by mmdebstrap,
# and this checkout's wheel as WHISTLE_STREAM_SPEC (a release installs from PyPI instead).
#
#   tools/build_addon.sh                                    # amd64, as localhost/whistle-stream-addon:amd64
#   tools/build_addon.sh --arch arm64                       # aarch64, under qemu-user-static
#
# WARM=0 in the environment skips compiling the kernels in.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=amd64
TAG=""
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) ARCH=$2; shift 2 ;;
        --tag) TAG=$2; shift 2 ;;
        *) echo "usage: $0 [--arch amd64|arm64] [--tag TAG]" >&2; exit 2 ;;
    esac
done
TAG=${TAG:-localhost/whistle-stream-addon:$ARCH}
source tools/image_base.sh
check_arch "$ARCH"
base=$(debian_base "$ARCH")

WHEELS=$(mktemp -d "$CACHE/addon-wheels.XXXXXX")   # this build's own: builds may run side by side
trap 'rm -rf "$WHEELS"' EXIT
say "building this checkout's wheel"
${PYTHON:-python3} -m pip wheel --quiet --no-deps --wheel-dir "$WHEELS" . \
    || { echo "$0: building the wheel needs pip (Debian: python3-pip, or run it in the project's .venv)" >&2; exit 1; }
wheel=$(basename "$WHEELS"/whistle_stream-*.whl)
say "building $TAG for linux/$ARCH from $base"
podman build --format docker --platform "linux/$ARCH" --build-arg BUILD_FROM="$base" --build-arg WARM="${WARM:-1}" \
    --build-arg WHISTLE_STREAM_SPEC="/run/wheels/$wheel[server]" --volume "$WHEELS:/run/wheels:ro" \
    --build-arg WHISTLE_STREAM_SHA256="$(sha256sum "$WHEELS/$wheel" | cut -d' ' -f1)" \
    ${CA:+--volume "$CA:/run/secrets/ca.crt:ro"} -t "$TAG" addon
say "built $TAG: $(podman image inspect "$TAG" --format '{{.Architecture}}, {{.Size}} bytes')"
