#!/bin/sh
# tools/install-deps.sh - install what kvr builds and tests with, from Debian's packages, without
# questions: a C compiler and make, OpenBLAS, stb, OpenMPI (the mpi transport and its tests),
# clang with its runtime (the libFuzzer target). Packages already there are left alone.
set -e
pkgs="gcc make libopenblas-dev libstb-dev libopenmpi-dev openmpi-bin clang libclang-rt-14-dev python3"
missing=""
for p in $pkgs; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends $missing
