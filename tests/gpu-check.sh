#!/bin/sh
# tests/gpu-check.sh - make gpu-check: everything kvr can show on one NVIDIA GPU, in one command of
# under 8 minutes (an H100), from one folder that also travels to a bare machine (CUDA toolkit and
# driver only: no OpenBLAS, no compiler needed, no network, none of ../shared).
#
#   sh tests/gpu-check.sh probe                     exit 0 when an NVIDIA GPU is visible, else 2 and why
#   sh tests/gpu-check.sh pack BUILD SHARED DIR     (make gpu-pack) put into DIR what a bare machine lacks:
#       BUILD's programs and the shared libraries they need that are neither the C library nor CUDA's
#       (OpenBLAS, gfortran, quadmath), the reference models of SHARED (and models/gguf's SmolLM2 when
#       present and within the size limit), gzip-compressed; DIR stays under 63 MiB (a device call
#       carries 64 MiB with the working tree): what does not fit is left out and listed in DIR/MANIFEST
#   sh tests/gpu-check.sh run DIR                   (make gpu-check) unpack DIR into a temporary folder and
#       run there, with a deadline for every step and 450 s in all (KVR_GPU_CHECK_SECONDS):
#        1. the GPU, driver and toolkit; the bounds: memory bandwidth and dense F16/BF16 tensor-core rate,
#           measured through PyTorch when it is installed (a copy, an 8192^3 product), else the
#           datasheet's figures for the card's name
#        2. test-cuda-host, then test-ops -b cuda under KVR_CUDA_SYNC=1 (a fault names its node)
#        3. kvr-compare --backend cuda on every reference model, one rank; kvr and ring-kv on 2 ranks
#           when there are 2+ GPUs
#        4. speed: tinyllama-1.1b-shaped F16 and Q4_K models made by kvr-gen; kvr-bench --backend cuda:
#           TTFT at 512, 4k, 16k, 32k prompt tokens, decode tok/s after 4k and 32k, beside the bounds
#        5. compute-sanitizer memcheck and racecheck on test-ops' ATTN, MERGE_ATTN and MUL_MAT cases
#        6. when time is left: prefill at 4k and 32k again with KVR_CUDA_TF32=1 (tensor-core products)
#       The results (markdown) go to $OUT/gpu-check.md when OUT is set, else DIR/gpu-check.md; the
#       whole log beside them (gpu-check.log). Exit 0: every step passed; 1: a step failed or ran out
#       of time; 2: no GPU (said in one line, within seconds).
#
# On a lent device machine (the session tool `run`), after `make gpu-pack` here:
#   command: sh tests/gpu-check.sh run gpu-pack        carry: ["gpu-pack"]        timeout_s: 540
# (not make gpu-check there: make would try to rebuild without OpenBLAS).

mode=$1
budget=${KVR_GPU_CHECK_SECONDS:-450}

probe() {
    if ! command -v nvidia-smi > /dev/null 2>&1; then
        echo "gpu-check: no NVIDIA GPU here (nvidia-smi, the driver's tool, is not installed): nothing to check; make gpu-pack prepares a folder for a machine that has one"
        return 2
    fi
    gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
    if [ "$gpus" -eq 0 ]; then
        echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L lists none): nothing to check"
        return 2
    fi
    return 0
}

# ---------------------------------------------------------------------------------------------
# pack
# ---------------------------------------------------------------------------------------------
if [ "$mode" = pack ]; then
    build=$2; shared=$3; dir=$4
    [ -n "$dir" ] && [ -d "$build" ] || { echo "usage: gpu-check.sh pack BUILD SHARED DIR"; exit 1; }
    limit=$((63 * 1048576))
    progs="kvr-run kvr-compare kvr-bench kvr-gen test-ops test-cuda-host"
    for p in $progs; do [ -x "$build/$p" ] || { echo "gpu-check pack: $build/$p is missing (make gpu-pack builds it)"; exit 1; }; done
    rm -rf "$dir"
    mkdir -p "$dir/bin" "$dir/lib" "$dir/models"
    manifest="$dir/MANIFEST"
    echo "# made $(date -u '+%Y-%m-%d %H:%M UTC') from $(git rev-parse --short HEAD 2> /dev/null || echo '?')$(git diff --quiet 2> /dev/null || echo ' (with uncommitted changes)')" > "$manifest"
    used=0
    # add FILE DEST: gzip FILE to DIR/DEST.gz unless that passes the limit
    add() {
        gzip -9 -c "$1" > "$dir/$2.gz.tmp"
        sz=$(wc -c < "$dir/$2.gz.tmp")
        if [ $((used + sz)) -gt $limit ]; then
            rm -f "$dir/$2.gz.tmp"
            echo "left-out $2 ($(wc -c < "$1") bytes; $sz compressed would pass the limit)" >> "$manifest"
            return 1
        fi
        mv "$dir/$2.gz.tmp" "$dir/$2.gz"
        used=$((used + sz))
        echo "file $2 $(wc -c < "$1") $sz" >> "$manifest"
    }
    for p in $progs; do add "$build/$p" "bin/$p" || exit 1; done
    # the libraries a bare machine lacks: every one the programs load but the C runtime's and CUDA's
    libs=$(for p in $progs; do ldd "$build/$p"; done | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
           grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcudart|libcublas|libcublasLt|libnccl)\.so')
    for l in $libs; do add "$(readlink -f "$l")" "lib/$(basename "$l")" || exit 1; done
    # the reference models, smallest first so that a large one is what a tight limit leaves out
    for m in "$shared/models/stories260K.gguf" "$shared"/reference/tiny-llama-*.gguf "$shared"/reference/archs/*.gguf \
             "$shared/reference/tiny-falcon-mqa.gguf" models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf; do
        if [ -f "$m" ]; then add "$m" "models/$(basename "$m")"; else echo "absent $m" >> "$manifest"; fi
    done
    echo "total $used" >> "$manifest"
    echo "gpu-check pack: $dir holds $(grep -c '^file' "$manifest") files, $((used / 1048576)) MiB compressed (limit 63); $(grep -c '^left-out' "$manifest") left out (see $manifest)"
    grep '^left-out' "$manifest"
    exit 0
fi

if [ "$mode" = probe ]; then
    probe
    exit $?
fi

[ "$mode" = run ] || { echo "usage: gpu-check.sh probe | pack BUILD SHARED DIR | run DIR"; exit 1; }

# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------
probe || exit 2
export PATH="$PATH:/usr/local/cuda/bin" # the toolkit's cuobjdump, compute-sanitizer
pack=$2
[ -n "$pack" ] && [ -f "$pack/MANIFEST" ] || { echo "gpu-check: no pack at '$pack' (make gpu-pack makes one)"; exit 1; }
t_start=$(date +%s)
res=${OUT:-$pack}/gpu-check.md
log=${OUT:-$pack}/gpu-check.log
work=$(mktemp -d "${TMPDIR:-/tmp}/kvr-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
: > "$log"
pass=0; fail=0
note() { echo "$*" | tee -a "$res"; }
left() { echo $((budget - ($(date +%s) - t_start))); }

# step NAME SECONDS CMD...: run CMD with a deadline (its own, cut to what is left of the budget);
# its output goes to $work/step.out and the log. Returns CMD's status (124: out of time, 125: no time).
# after a kvr-bench step: it exits 0 even when a point failed; a point missing from its CSV fails here
bench_points() { # name, points wanted
    got=$(grep -c '^single,' "$work/step.out")
    if [ "$got" -lt "$2" ]; then
        fail=$((fail + 1)); note "| $1 | FAIL: $got of $2 points timed: $(grep -m 1 '^kvr-bench: ' "$work/step.out" | tr '|' '/') | |"
    fi
}

step() {
    name=$1; limit=$2; shift 2
    l=$(left)
    [ "$limit" -gt "$l" ] && limit=$l
    if [ "$limit" -lt 5 ]; then
        note "| $name | skipped: the check's $budget s were spent | |"
        fail=$((fail + 1))
        return 125
    fi
    echo "=== $name (limit ${limit}s): $*" >> "$log"
    s0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$work/step.out" 2>&1
    rc=$?
    dt=$(( $(date +%s) - s0 ))
    tail -n 3000 "$work/step.out" >> "$log" # a sanitizer finding thousands of errors stays readable
    echo "=== $name: exit $rc after ${dt}s" >> "$log"
    summary=$(grep -E '[0-9]+ passed, [0-9]+ failed|^kvr-compare: (PASS|FAIL)|ERROR SUMMARY|RACECHECK SUMMARY|^logits of' "$work/step.out" | tail -n 2 | tr '\n' ' ' | tr '|' '/')
    if [ $rc -eq 0 ]; then
        pass=$((pass + 1)); note "| $name | ok (${dt} s) | $summary |"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        fail=$((fail + 1)); note "| $name | TIMEOUT after ${dt} s | $summary |"
    else
        fail=$((fail + 1)); note "| $name | FAIL: exit $rc (${dt} s) | $summary $(tail -n 1 "$work/step.out" | tr '|' '/') |"
    fi
    return $rc
}

# unpack
for f in $(find "$pack" -name '*.gz'); do
    rel=${f#"$pack"/}
    mkdir -p "$work/$(dirname "$rel")"
    gzip -dc "$f" > "$work/${rel%.gz}" || { echo "gpu-check: cannot unpack $f"; exit 1; }
done
chmod +x "$work"/bin/*
bin=$work/bin
export LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# CUDA's libraries where the toolkit of this machine keeps them (the build's rpath is the build
# machine's): every one the programs miss is searched for in the usual places
for lib in $(ldd "$bin/kvr-run" | awk '/not found/ { print $1 }' | sort -u); do
    found=$(find /usr/local /usr/lib /usr/lib64 /opt -name "$lib" 2> /dev/null | head -n 1)
    if [ -n "$found" ]; then export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$found")"; fi
done

{
    echo "# make gpu-check: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "pack: $(head -n 1 "$pack/MANIFEST" | sed 's/^# //')"
    grep '^left-out\|^absent' "$pack/MANIFEST" | sed 's/^/    /'
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    nvcc --version 2> /dev/null | tail -n 2
    command -v compute-sanitizer > /dev/null 2>&1 && echo "compute-sanitizer: $(command -v compute-sanitizer)"
    missing=$(ldd "$bin/kvr-run" | grep 'not found')
    [ -n "$missing" ] && echo "still missing libraries: $missing"
    echo '```'
    echo
} > "$res"
cat "$res"
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)
n_gpu=$(nvidia-smi -L | grep -c '^GPU ')

# 1. the bounds
bw=""; tc=""; how="measured through PyTorch"
if command -v python3 > /dev/null 2>&1; then
    timeout 60 python3 - > "$work/peak" 2>> "$log" << 'EOF'
import torch, time
if not torch.cuda.is_available(): raise SystemExit(1)
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
def best(f, n):
    t = []
    for _ in range(n):
        torch.cuda.synchronize(); a = time.perf_counter(); f(); torch.cuda.synchronize(); t.append(time.perf_counter() - a)
    return min(t)
best(lambda: y.copy_(x), 3)
bw = 2 * x.numel() / best(lambda: y.copy_(x), 10)
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a)
best(lambda: a @ b, 3)
tc = 2 * 8192 ** 3 / best(lambda: a @ b, 10)
print(bw, tc)
EOF
    if [ $? -eq 0 ]; then read -r bw tc < "$work/peak"; fi
fi
if [ -z "$bw" ]; then
    how="datasheet figures for '$gpu_name' (dense F16/BF16 tensor cores)"
    case "$gpu_name" in
        *H200*)            bw=4.8e12;  tc=989e12 ;;
        *H100*PCIe*)       bw=2.0e12;  tc=756e12 ;;
        *H100*)            bw=3.35e12; tc=989e12 ;;
        *A100*80GB*)       bw=2.0e12;  tc=312e12 ;;
        *A100*)            bw=1.55e12; tc=312e12 ;;
        *L40S*)            bw=0.864e12; tc=362e12 ;;
        *)                 bw=""; tc=""; how="no figures for '$gpu_name'" ;;
    esac
fi
{
    echo "bounds ($how): memory $(awk -v b="${bw:-0}" 'BEGIN { printf "%.0f GB/s", b / 1e9 }'), tensor cores $(awk -v t="${tc:-0}" 'BEGIN { printf "%.0f TFLOP/s", t / 1e12 }')"
    echo
    echo "| step | result | summary |"
    echo "|---|---|---|"
} >> "$res"

# 2. the host test and the op cases
step "test-cuda-host" 60 "$bin/test-cuda-host"
step "test-ops -b cuda (KVR_CUDA_SYNC=1)" 150 env KVR_CUDA_SYNC=1 "$bin/test-ops" -b cuda
if grep -q 'skipped, not run' "$work/step.out"; then # the GPU is there but kvr could not use it
    fail=$((fail + 1)); note "| test-ops -b cuda | FAIL: $(grep -m 1 'skipped, not run' "$work/step.out" | tr '|' '/') | |"
fi

# 3. kvr-compare on every reference model
prompt="Once upon a time, there was a little girl named Lily. She loved to play outside"
for m in "$work"/models/*.gguf; do
    [ -f "$m" ] || continue
    step "kvr-compare $(basename "$m" .gguf) --ranks 1" 60 "$bin/kvr-compare" -m "$m" -p "$prompt" --backend cuda -n 8
    if [ "$n_gpu" -ge 2 ]; then
        for s in kvr ring-kv; do
            step "kvr-compare $(basename "$m" .gguf) --strategy $s --ranks 2" 60 "$bin/kvr-compare" -m "$m" -p "$prompt" --backend cuda --strategy $s --ranks 2 -n 8
        done
    fi
done
[ "$n_gpu" -ge 2 ] || note "| kvr-compare on 2 ranks | not run: one GPU | |"

# 4. speed: tinyllama-1.1b shape (22 layers, width 2048, 32 heads of 64, 4 KV heads, FFN 5632,
# vocab 32000); bounds: TTFT >= max(FLOPs / tensor rate, weight bytes / bandwidth), decode <=
# bandwidth / (weight bytes + the F16 K/V rows read at that context)
speed="$work/speed.md"
{
    echo
    echo "speed (kvr-bench --backend cuda, tinyllama-1.1b shape, random prompt ids):"
    echo
    echo "| model | prompt | TTFT ms | bound ms | of bound | decode tok/s after it | bound tok/s | of bound |"
    echo "|---|---|---|---|---|---|---|---|"
} > "$speed"
for ty in f16 q4_k; do
    model=$work/tinyllama-$ty.gguf
    step "kvr-gen tinyllama-1.1b $ty" 120 "$bin/kvr-gen" --preset tinyllama-1.1b --type $ty --seed 1 -q -o "$model" || continue
    wbytes=$(wc -c < "$model")
    for set in "512,4k 3 1" "16k,32k 1 0"; do
        set -- $set
        step "kvr-bench $ty --ctx $1" 200 "$bin/kvr-bench" --backend cuda -m "$model" --ctx "$1" -r "$2" --warmup "$3" --decode 32 -o csv || continue
        bench_points "kvr-bench $ty --ctx $1" 2
        grep -E '^single,' "$work/step.out" | while IFS=, read -r _ _ _ _ p _ med _ _ _ _ _ _ _ _ dec _ _ _; do
            awk -v ty=$ty -v p="$p" -v med="$med" -v dec="$dec" -v wb="$wbytes" -v bw="${bw:-0}" -v tc="${tc:-0}" 'BEGIN {
                matmul = 22 * (2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632) + 2048 * 32000
                flops = 2 * matmul * p + 2 * 2 * p * p / 2 * 22 * 32 * 64
                tb = (tc > 0 ? flops / tc : 0); mb = (bw > 0 ? wb / bw : 0)
                bound = (tb > mb ? tb : mb) * 1e3
                kv = 2 * 22 * 4 * 64 * 2 * p
                dbound = (bw > 0 ? bw / (wb + kv) : 0)
                # (comparisons in parentheses: a bare > among the printf arguments is a redirection)
                printf "| %s | %d | %.1f | %.1f | %.0f%% | %s | %s | %s |\n", ty, p, med, bound, (med > 0 ? 100 * bound / med : 0),
                       (dec > 0 ? sprintf("%.1f", dec) : "-"), (dbound > 0 ? sprintf("%.0f", dbound) : "-"),
                       (dec > 0 && dbound > 0 ? sprintf("%.0f%%", 100 * dec / dbound) : "-")
            }' >> "$speed"
        done
    done
    # the same prompts' products on tensor cores (KVR_CUDA_TF32=1), after the sanitizers below
    [ -f "$model" ] && mv "$model" "$work/keep-$ty.gguf"
done

# the tensor-core kernel's machine code: HMMA instructions in k_fattn (what make KVR_CUDA=1 built)
if command -v cuobjdump > /dev/null 2>&1; then
    cuobjdump -sass "$bin/test-ops" > "$work/sass" 2>> "$log"
    n=$(awk '/Function : / { f = /k_fattn/ } f && /HMMA|HGMMA/ { n++ } END { print n + 0 }' "$work/sass")
    if [ "$n" -gt 0 ]; then pass=$((pass + 1)); note "| SASS of k_fattn | ok: $n HMMA/HGMMA instructions | |"
    else fail=$((fail + 1)); note "| SASS of k_fattn | FAIL: no HMMA | |"; fi
fi

# 5. the sanitizers, last: they are the slowest
if command -v compute-sanitizer > /dev/null 2>&1; then
    for tool in memcheck racecheck; do
        step "compute-sanitizer $tool: ATTN, MERGE_ATTN" 90 compute-sanitizer --tool $tool --error-exitcode 3 "$bin/test-ops" -b cuda -o ATTN,MERGE_ATTN
        step "compute-sanitizer $tool: MUL_MAT" 90 compute-sanitizer --tool $tool --error-exitcode 3 "$bin/test-ops" -b cuda -o MUL_MAT
    done
else
    note "| compute-sanitizer | FAIL: not installed | |"
    fail=$((fail + 1))
fi

# prefill with KVR_CUDA_TF32=1 (what the exact f32 products cost against tensor cores), if time is left
for ty in f16 q4_k; do
    model=$work/keep-$ty.gguf
    [ -f "$model" ] || continue
    wbytes=$(wc -c < "$model")
    if step "kvr-bench $ty --ctx 4k,32k KVR_CUDA_TF32=1" 150 env KVR_CUDA_TF32=1 "$bin/kvr-bench" --backend cuda -m "$model" --ctx 4k,32k -r 1 --warmup 0 -o csv; then
        bench_points "kvr-bench $ty KVR_CUDA_TF32=1" 2
        grep -E '^single,' "$work/step.out" | while IFS=, read -r _ _ _ _ p _ med _; do
            awk -v ty="$ty tf32" -v p="$p" -v med="$med" -v wb="$wbytes" -v bw="${bw:-0}" -v tc="${tc:-0}" 'BEGIN {
                matmul = 22 * (2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632) + 2048 * 32000
                flops = 2 * matmul * p + 2 * 2 * p * p / 2 * 22 * 32 * 64
                tb = (tc > 0 ? flops / tc : 0); mb = (bw > 0 ? wb / bw : 0)
                bound = (tb > mb ? tb : mb) * 1e3
                printf "| %s | %d | %.1f | %.1f | %.0f%% | - | - | - |\n", ty, p, med, bound, (med > 0 ? 100 * bound / med : 0)
            }' >> "$speed"
        done
    fi
    rm -f "$model"
done

cat "$speed" >> "$res"
{
    echo
    echo "gpu-check: $pass passed, $fail failed, $(( $(date +%s) - t_start )) s"
} >> "$res"
tail -n 12 "$speed"
echo "gpu-check: $pass passed, $fail failed, $(( $(date +%s) - t_start )) s; results: $res, log: $log"
[ $fail -eq 0 ]
