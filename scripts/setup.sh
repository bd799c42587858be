#!/usr/bin/env bash
# Installs the build dependencies (Debian 12 / Ubuntu, as root or with sudo), builds flatmoe
# into build/ and installs it on the PATH (`cmake --install build`: /usr/local/bin as root, else
# ~/.local/bin; FLATMOE_PREFIX=DIR installs into DIR/bin, FLATMOE_INSTALL=0 skips it). Safe to run
# again: it only installs what is missing and rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(build-essential cmake libopenblas-openmp-dev libcjson-dev fortunes openmpi-bin libopenmpi-dev)
pkgs+=(gnuplot-nox) # flatmoe report (tests/cli_report.sh)
pkgs+=(libpcre2-dev libutf8proc-dev) # the tokenizer (src/tok): PCRE2 regexes, utf8proc NFC
pkgs+=(python3-numpy) # the Python binding's test (python/run_test.sh)
pkgs+=(clang libclang-rt-dev libomp-dev) # the fuzz targets (fuzz/run.sh: libFuzzer, clang's OpenMP)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# FLATMOE_MPI=ON: Open MPI was installed above, so its absence is an error, not a skipped test.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DFLATMOE_MPI=ON >/dev/null
cmake --build build -j"$(nproc)"
if [ "${FLATMOE_INSTALL:-1}" != 0 ]; then
    prefix=${FLATMOE_PREFIX:-}
    [ -n "$prefix" ] || { [ "$(id -u)" -eq 0 ] && prefix=/usr/local || prefix=$HOME/.local; }
    cmake --install build --prefix "$prefix" >/dev/null
    case ":$PATH:" in
    *":$prefix/bin:"*) echo "setup: installed $prefix/bin/flatmoe" ;;
    *) echo "setup: installed $prefix/bin/flatmoe; add it to the PATH: export PATH=\"$prefix/bin:\$PATH\"" ;;
    esac
fi
