#!/usr/bin/env bash
# The engine on 64-bit ARM, under Debian's qemu-user-static, in an arm64 Debian rootfs made by
# mmdebstrap: the demo model's transcripts of 8 held clips and a stream's committed text, each
# against x86's (tools/check_arm64.py: a clip x86 itself reads two ways under float noise is a
# tie), `warm`, `whistle-listen --local`, and a subset of the kernels' twin tests. Run as root on
# an x86-64 Debian host:
#
#   tools/check_arm64.sh            # prints each step's minutes; exit 0 only if everything matched
#
# Kept between runs, outside the clone, in $WHISTLE_ARM64_CACHE (/var/cache/whistle-stream/arm64):
# the rootfs (about 5-10 minutes to make), its venv, and Numba's cache of the kernels (the first
# compile under emulation takes about 12 CPU-minutes; the cache is dropped whenever a kernel
# source changes, `whistle_stream/kernels/_cache.py`, so it is keyed by the sources).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
CACHE=${WHISTLE_ARM64_CACHE:-/var/cache/whistle-stream/arm64}
ROOT=$CACHE/rootfs
START=$(date +%s)
step() { printf '[arm64 %5.1f min] %s\n' "$(echo "($(date +%s) - $START) / 60" | bc -l)" "$*"; }

# The twin tests that run under emulation: kernels against their NumPy twins, no subprocess of
# another simd path, no reference model (no JAX on arm64 here).
TWINS=(tests/test_kernels.py tests/test_decoder.py)
TWIN_MARKS='not slow and not reference'
TWIN_NAMES='twin or match or equal'

need=""
for tool in qemu-aarch64-static mmdebstrap update-binfmts bc; do command -v "$tool" >/dev/null || need=1; done
if [ -n "$need" ]; then
    step "installing qemu-user-static, binfmt-support, mmdebstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support mmdebstrap bc >/dev/null
fi
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

mkdir -p "$CACHE"
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    step "making the arm64 rootfs (mmdebstrap --arch=arm64)"
    rm -rf "$ROOT.tmp"
    mmdebstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates,libsndfile1 bookworm "$ROOT.tmp" >"$CACHE/mmdebstrap.log" 2>&1
    mv "$ROOT.tmp" "$ROOT"
fi

# pip inside the rootfs: the host's configuration, constraints and CA bundle
for f in /etc/pip.conf /etc/xdg/pip/pip.conf /etc/xdg/pip/constraints.txt /etc/resolv.conf /etc/ssl/certs/ca-certificates.crt; do
    [ -f "$f" ] && { mkdir -p "$ROOT$(dirname "$f")"; cp -L "$f" "$ROOT$f"; }
done
mounted=()
cleanup() { for m in "${mounted[@]}"; do umount -l "$m" 2>/dev/null || true; done; }
trap cleanup EXIT
mountpoint -q "$ROOT/proc" || { mount -t proc proc "$ROOT/proc"; mounted+=("$ROOT/proc"); }
mountpoint -q "$ROOT/sys" || { mount --rbind /sys "$ROOT/sys"; mounted+=("$ROOT/sys"); }
mountpoint -q "$ROOT/dev" || { mount --rbind /dev "$ROOT/dev"; mounted+=("$ROOT/dev"); }
in_arm() { chroot "$ROOT" /usr/bin/env -i PATH=/opt/venv/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NUMBA_CACHE_DIR=/var/cache/numba "$@"; }

step "copying this checkout's files (tracked and untracked, not ignored)"
rm -rf "$ROOT/work/src" && mkdir -p "$ROOT/work/src"
git ls-files -co --exclude-standard -z | xargs -0 tar -cf - | tar -xf - -C "$ROOT/work/src"

deps=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$ROOT/opt/venv/.deps" 2>/dev/null)" != "$deps" ]; then
    step "installing the project's dependencies in an arm64 venv (pip, aarch64 wheels)"
    in_arm python3 -m venv /opt/venv
    in_arm /opt/venv/bin/pip install -q '/work/src[server]' pytest
    echo "$deps" > "$ROOT/opt/venv/.deps"
fi
# editable: the clips and the twin tests import the one copy, whose kernels' folder keys one cache
step "installing this checkout's whistle-stream (editable, /work/src)"
in_arm /opt/venv/bin/pip install -q --no-deps -e /work/src
in_arm python3 -c 'import platform, numba; print("arm64 python:", platform.machine(), "numba", numba.__version__)'

step "x86: the held clips, a stream, and their text"
CLIPS=$(mktemp -d)
if [ -x .venv/bin/python ]; then PY=.venv/bin/python LISTEN=.venv/bin/whistle-listen; else PY=python3 LISTEN=whistle-listen; fi
"$PY" tools/check_arm64.py make "$CLIPS"
"$LISTEN" --local --file "$CLIPS/stream.wav" --speed 50 >"$CLIPS/x86-listen.txt"
mkdir -p "$ROOT/work/clips" && cp "$CLIPS"/* "$ROOT/work/clips/" && rm -rf "$CLIPS"

step "arm64: the same clips and stream (the first run compiles every kernel under emulation)"
status=0
in_arm /opt/venv/bin/python /work/src/tools/check_arm64.py compare /work/clips || status=1

step "arm64: whistle-stream warm, and whistle-listen --local on the stream against x86's"
in_arm /opt/venv/bin/whistle-stream warm || status=1
in_arm /opt/venv/bin/whistle-listen --local --file /work/clips/stream.wav --speed 50 >"$ROOT/work/clips/arm64-listen.txt" || status=1
if cmp -s "$ROOT/work/clips/arm64-listen.txt" "$ROOT/work/clips/x86-listen.txt"; then
    echo "whistle-listen --local: the same lines as x86's ($(wc -l <"$ROOT/work/clips/x86-listen.txt"))"
else
    echo "whistle-listen --local: DIFFERENT"; diff "$ROOT/work/clips/arm64-listen.txt" "$ROOT/work/clips/x86-listen.txt" || true
    status=1
fi

step "arm64: the kernels' twin tests (${TWINS[*]}, -m '$TWIN_MARKS' -k '$TWIN_NAMES')"
in_arm /bin/sh -c "cd /work/src && python -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning \
    -m '$TWIN_MARKS' -k '$TWIN_NAMES' ${TWINS[*]} 2>&1 | tail -n 15" | tee "$CACHE/twins.log"
grep -qE '^[0-9]+ passed' "$CACHE/twins.log" && ! grep -qE 'failed|error' "$CACHE/twins.log" || status=1

step "done: $([ $status = 0 ] && echo 'arm64 matched x86' || echo 'arm64 DIFFERED or failed')"
exit $status
