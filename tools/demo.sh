#!/bin/sh
# tools/demo.sh BUILD SHARED - the main job on an embedded default: a story prompt prefilled by
# KV-Runahead on 2 ranks (threads of this process), then 48 greedy tokens, with each rank's
# counters. It uses the stories260K model from SHARED when it is there, else a tiny random
# Llama that kvr-gen writes (its text is noise, the mechanics are the same).
build=${1:-build}
shared=${2:-../shared}
model=$shared/models/stories260K.gguf
if [ -f "$model" ]; then
    exec "$build/kvr-run" -m "$model" -p "Once upon a time" -n 48 --temp 0 --ranks 2 --strategy kvr --stats
fi
model=$build/demo-tiny.gguf
[ -f "$model" ] || "$build/kvr-gen" --preset tiny --type f32 --seed 1 -o "$model" || exit 1
exec "$build/kvr-run" -m "$model" --tokens 1,72,101,108,108,111,44,32,119,111,114,108,100 -n 48 --temp 0 --ranks 2 --strategy kvr --stats
