#!/usr/bin/env bash
# Run a built image (any architecture podman can run here: arm64 under qemu-user-static) and check
# it as a user would: /readyz, the ready line's kernels, one transcript through the OpenAI REST
# route, and the health check's status.
#
#   tools/check_image.sh localhost/whistle-stream:latest-arm64 [CLIP.wav] [READY_TIMEOUT_S]
#
# Prints each answer; exits 1 if one is missing. The clip defaults to a sentence spoken by espeak-ng.
set -euo pipefail
IMAGE=${1:?usage: $0 IMAGE [CLIP.wav] [READY_TIMEOUT_S]}
CLIP=${2:-}
TIMEOUT=${3:-900}
CACHE=${WHISTLE_IMAGE_CACHE:-/var/cache/whistle-stream/image}
if [ -z "${CONTAINERS_CONF:-}" ] && [ -f "$CACHE/containers.conf" ]; then export CONTAINERS_CONF=$CACHE/containers.conf; fi
WORK=$(mktemp -d)
if [ -z "$CLIP" ]; then
    CLIP=$WORK/clip.wav
    espeak-ng -w "$WORK/raw.wav" "Set a timer for ten minutes."
    sox "$WORK/raw.wav" -r 16000 -c 1 -b 16 "$CLIP"
fi
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
NAME=whistle-check-$$
cleanup() { podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT
START=$(date +%s)
# no systemd here to time the health check: it runs by hand below (podman says so once on stderr)
podman run -d --name "$NAME" -e WHISTLE_PORT="$PORT" -e WHISTLE_HOST=127.0.0.1 -e WHISTLE_PROCESSES=1 "$IMAGE" \
    >/dev/null 2>"$WORK/run.err" || { cat "$WORK/run.err"; exit 1; }
echo "image: $IMAGE ($(podman image inspect "$IMAGE" --format '{{.Architecture}}'))"
until curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null; do
    if [ "$(podman inspect "$NAME" --format '{{.State.Running}}')" != true ] || [ $(( $(date +%s) - START )) -gt "$TIMEOUT" ]; then
        echo "not ready after $(( $(date +%s) - START )) s:"; podman logs "$NAME" 2>&1 | tail -20; exit 1
    fi
    sleep 1
done
echo "/readyz: 200 after $(( $(date +%s) - START )) s"
podman logs "$NAME" 2>&1 | grep '"event": "ready"' | head -1 | python3 -c 'import json, sys; e = json.loads(sys.stdin.read()); print("ready line, kernels:", e["kernels"])'
TEXT=$(curl -sf -F file=@"$CLIP" -F model=whistle -F response_format=text "http://127.0.0.1:$PORT/v1/audio/transcriptions")
echo "transcript: $TEXT"
podman healthcheck run "$NAME" >/dev/null && echo "health: $(podman inspect "$NAME" --format '{{.State.Health.Status}}')"
[ -n "$TEXT" ]
