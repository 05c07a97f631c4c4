#!/bin/sh
# tests/bench-matrix.sh BUILD [short] - the speed matrix of the files people run, with default flags
# and 2 threads: decode (tg 64 after a 16-token prompt) and prefill at 16, 64, 512 and 2048 tokens
# on SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (where tools/install-deps.sh installed
# them in models/gguf; skipped, saying so, where not) and on kvr-gen models in real shapes
# (qwen2.5-0.5b, llama-3.2-1b, qwen3-0.6b, gemma-3-1b; random weights, written once into
# BUILD/bench/) in llama-quantize's mixtures (Q4_K_M, Q5_K_M, Q6_K, Q8_0).
# Where llama.cpp's llama-bench is on the PATH (or at $LLAMA_BENCH) it runs on the same file,
# point by point, its runs alternating with kvr's (tests/bench-pair.sh): each side's median of
# RUNS, and their ratio. Decode is tg 64 after a 16-token prompt on both (llama-bench -d 16: the
# depth prefilled untimed); both with their default flags (F16 caches; llama.cpp's flash
# attention on auto). Every run is its own process with one untimed warm-up of the point.
# `short` (make bench-short, about 10 minutes on 2 quiet cores): the two real files and
# qwen2.5-0.5b Q4_K_M at every point, 3 pairs a point. KVR_MATRIX_RUNS (default 3),
# KVR_MATRIX_MODELS (kvr-gen presets; none), KVR_MATRIX_FTYPES and KVR_MATRIX_CTX choose otherwise;
# the table goes to stdout and to BUILD/bench/matrix.md (each row also to stderr as it comes),
# with the wall time and the load.
# Absolute numbers only mean something on a quiet machine.
set -e
build=${1:-build}
form=${2:-full}
dir=$build/bench
mkdir -p "$dir"
if [ "$form" = short ]; then
    runs=${KVR_MATRIX_RUNS:-3}
    presets=${KVR_MATRIX_MODELS:-qwen2.5-0.5b}
    ftypes=${KVR_MATRIX_FTYPES:-q4_k_m}
    ctx=${KVR_MATRIX_CTX:-16,64,512,2048}
else
    runs=${KVR_MATRIX_RUNS:-3}
    presets=${KVR_MATRIX_MODELS:-qwen2.5-0.5b llama-3.2-1b qwen3-0.6b gemma-3-1b}
    ftypes=${KVR_MATRIX_FTYPES:-q4_k_m q5_k_m q6_k q8_0}
    ctx=${KVR_MATRIX_CTX:-16,64,512,2048}
fi
[ "$presets" = none ] && presets=
lb=${LLAMA_BENCH:-$(command -v llama-bench 2>/dev/null || true)}
out=$dir/matrix.md
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# models: "label path" lines
: > "$tmp/models"
for f in "models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M Q4_1" "models/gguf/gemma-3-270m-Q4_K_M.gguf Gemma-3-270M Q4_K_M"; do
    path=${f%% *}
    if [ -f "$path" ]; then
        echo "${f#* }|$path" >> "$tmp/models"
    else
        echo "bench-matrix: $path is not there (tools/install-deps.sh installs it): skipped" >&2
    fi
done
for p in $presets; do
    for ft in $ftypes; do
        model=$dir/$p-$ft.gguf
        [ -f "$model" ] || "$build/kvr-gen" --preset "$p" --ftype "$ft" --seed 1 -o "$model"
        echo "$p $ft|$model" >> "$tmp/models"
    done
done

. tests/bench-pair.sh
pair_threads=2
pair_log=$dir/matrix-llama-bench.log
: > "$pair_log"
points="$(echo "$ctx" | tr ',' '\n' | sed 's/^/pp/') tg64@d16"

{
    echo "## kvr$( [ -n "$lb" ] && echo " beside llama.cpp (llama-bench, same file)") - 2 threads, default flags, tok/s (median of $runs$( [ -n "$lb" ] && echo " alternating pairs"))"
    echo
    echo "ppN: prefill of N tokens; tg64 @ d16: 64 decode steps after a 16-token prompt (llama-bench -d 16)."
    echo
    echo "| model | figure | kvr | llama.cpp | ratio |"
    echo "|---|---|---:|---:|---:|"
} > "$out"
t0=$(date +%s)
while IFS='|' read -r label path; do
    echo "bench-matrix: $label" >&2
    for f in $points; do
        # shellcheck disable=SC2046 # two medians
        set -- $(pair_point "$path" "$f" "$runs")
        pair_row "$label" "$(echo "$f" | sed 's/@d/ @ d/')" "$1" "$2" | tee -a "$out" >&2
    done
done < "$tmp/models"
{
    echo
    echo "wall time $(( $(date +%s) - t0 )) s; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    if [ -z "$lb" ]; then echo "(llama-bench is not on the PATH nor at \$LLAMA_BENCH: kvr alone)"; fi
    if [ -s "$pair_log" ]; then echo "(llama-bench printed errors: $pair_log)"; fi
} >> "$out"
cat "$out"
