#!/bin/sh
# tests/bench-matrix.sh BUILD [short] - the speed matrix of the files people run, with default flags
# and 2 threads: decode (tg 64 after a 16-token prompt) and prefill at 16, 64, 512 and 2048 tokens
# on SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (where tools/install-deps.sh installed
# them in models/gguf; skipped, saying so, where not) and on kvr-gen models in real shapes
# (qwen2.5-0.5b, llama-3.2-1b, qwen3-0.6b, gemma-3-1b; random weights, written once into
# BUILD/bench/) in llama-quantize's mixtures (Q4_K_M, Q5_K_M, Q6_K, Q8_0).
# Where llama.cpp's llama-bench is on the PATH (or at $LLAMA_BENCH) it runs on the same file
# right after kvr, point by point, and the table shows both and their ratio; its decode figure is
# tg 64 on an empty cache (llama-bench's own), kvr's is after the 16-token prompt.
# `short` (make bench-short, minutes): the two real files and qwen2.5-0.5b Q4_K_M, prompts of 16,
# 64 and 512, 2 runs a point. KVR_MATRIX_RUNS (default 3), KVR_MATRIX_MODELS (kvr-gen presets; none),
# KVR_MATRIX_FTYPES and KVR_MATRIX_CTX choose otherwise; the table goes to stdout and to
# BUILD/bench/matrix.md. Absolute numbers only mean something on a quiet machine.
set -e
build=${1:-build}
form=${2:-full}
dir=$build/bench
mkdir -p "$dir"
if [ "$form" = short ]; then
    runs=${KVR_MATRIX_RUNS:-2}
    presets=${KVR_MATRIX_MODELS:-qwen2.5-0.5b}
    ftypes=${KVR_MATRIX_FTYPES:-q4_k_m}
    ctx=${KVR_MATRIX_CTX:-16,64,512}
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

# kvr: prefill at every length (the median of $runs), decode after a 16-token prompt
kvr_points() { # MODEL -> "figure tok/s" lines
    "$build/kvr-bench" -m "$1" --ctx "$ctx" -t 2 -r "$runs" -o csv 2>/dev/null < /dev/null |
        awk -F, 'NR > 1 { printf "pp%s %s\n", $5, $11 }'
    "$build/kvr-bench" -m "$1" --ctx 16 --decode 64 -t 2 -r "$runs" -o csv 2>/dev/null < /dev/null |
        awk -F, 'NR > 1 { printf "tg64 %s\n", $16 }'
}

# llama-bench: the same lengths, tg 64; its markdown rows end in "| test | t/s ± sd |"
llama_points() {
    "$lb" -m "$1" -t 2 -p "$ctx" -n 64 -r "$runs" -o md 2>/dev/null < /dev/null |
        awk -F'|' '/ (pp|tg)[0-9]+ / { t = $(NF - 2); s = $(NF - 1); gsub(/ /, "", t); split(s, a, "±"); gsub(/ /, "", a[1]); print t, a[1] }'
}

{
    echo "## kvr$( [ -n "$lb" ] && echo " beside llama.cpp ($lb)") - 2 threads, default flags, tok/s (median of $runs)"
    echo
    if [ -n "$lb" ]; then
        echo "| model | figure | kvr | llama.cpp | ratio |"
        echo "|---|---|---:|---:|---:|"
    else
        echo "| model | figure | kvr |"
        echo "|---|---|---:|"
    fi
} > "$out"
while IFS='|' read -r label path; do
    echo "bench-matrix: $label" >&2
    kvr_points "$path" > "$tmp/kvr"
    : > "$tmp/llama"
    [ -n "$lb" ] && llama_points "$path" > "$tmp/llama"
    sort -V "$tmp/kvr" | while read -r fig v; do
        if [ -n "$lb" ]; then
            l=$(awk -v f="$fig" '$1 == f { print $2 }' "$tmp/llama")
            awk -v m="$label" -v f="$fig" -v k="$v" -v l="$l" 'BEGIN {
                lv = l == "" ? "-" : sprintf("%.1f", l); r = (l + 0 > 0) ? sprintf("%.2fx", k / l) : "-"
                printf "| %s | %s | %.1f | %s | %s |\n", m, f, k, lv, r }'
        else
            awk -v m="$label" -v f="$fig" -v k="$v" 'BEGIN { printf "| %s | %s | %.1f |\n", m, f, k }'
        fi
    done >> "$out"
done < "$tmp/models"
cat "$out"
