#!/usr/bin/env bash
# Builds flatmoe's CPU backend on a machine without OpenBLAS/cJSON packages (the H200 machine),
# from Debian packages unpacked into .deps/root (fetched elsewhere with
#   apt-get download libopenblas0-openmp libopenblas-openmp-dev libopenblas-dev libcjson1 libcjson-dev libgfortran5
#   in .deps/; they are unpacked into /tmp/flatmoe-deps-root).
# Source this file: it exports LD_LIBRARY_PATH for the unpacked libraries.
DEPS=$(readlink -f "$(dirname "${BASH_SOURCE[0]}")/../.deps")
D=/tmp/flatmoe-deps-root
[ -d "$D" ] || for f in "$DEPS"/*.deb; do dpkg -x "$f" "$D"; done
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S "$(dirname "${BASH_SOURCE[0]}")/.." -B "${BUILD:-build}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INCLUDE_PATH="$D/usr/include" \
    -DCMAKE_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu/openblas-openmp;$D/usr/lib/x86_64-linux-gnu" >/dev/null &&
cmake --build "${BUILD:-build}" -j"$(nproc)" 2>&1 | grep -E "error|warning" || true
