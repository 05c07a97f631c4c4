#!/bin/sh
# tests/bench.sh BUILD - what `make bench` runs: prefill speed of a tinyllama-1.1b-shaped model
# (random weights from kvr-gen, written once into BUILD/bench/) at 512 and 2048 prompt tokens
# with 2 threads, beside what OpenBLAS sgemm reaches on the same shapes; then the parallel
# prefill strategies on 2 ranks x 1 thread against single x 2 threads. Long: minutes, not seconds.
# KVR_BENCH_TYPES (default "f32") and KVR_BENCH_CTX / KVR_BENCH_PAR_CTX choose what runs.
set -e
build=${1:-build}
dir=$build/bench
mkdir -p "$dir"
types=${KVR_BENCH_TYPES:-f32}
ctx=${KVR_BENCH_CTX:-512,2048}
par_ctx=${KVR_BENCH_PAR_CTX:-1k,2k,4k}
for t in $types; do
    model=$dir/tinyllama-1.1b-$t.gguf
    [ -f "$model" ] || "$build/kvr-gen" --preset tinyllama-1.1b --type "$t" --seed 1 -o "$model"
    echo "## prefill, single rank, 2 threads, $t"
    "$build/kvr-bench" -m "$model" --ctx "$ctx" -t 2 -r 3 --sgemm
    echo
done
model=$dir/tinyllama-1.1b-f32.gguf
echo "## parallel prefill: 2 ranks x 1 thread against single x 2 threads"
"$build/kvr-bench" -m "$model" --ctx "$par_ctx" --strategy single,tsp,kvr,ring-kv,ring-q --ranks 2 -r 3 2>/dev/null
