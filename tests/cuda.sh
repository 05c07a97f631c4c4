#!/bin/sh
# tests/cuda.sh CUDA_BUILD SHARED - what make test's CUDA build can show on this machine. Without a
# GPU: kvr-run --backend cuda exits with status 2 within 10 s saying that no CUDA device was found
# (issue 12's acceptance 2). With one: kvr-compare --backend cuda against the CPU on a prompt, one
# rank and two (the GPU's first check; see README). Ends with "N passed, M failed".
build=${1:-build/cuda}
shared=${2:-../shared}
pass=0; fail=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
model=$shared/models/stories260K.gguf
[ -f "$model" ] || { echo "no $model: 0 passed, 0 failed, 1 skipped"; exit 0; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT

t0=$(date +%s)
timeout 30 "$build/kvr-run" --backend cuda -m "$model" -p hi > "$out" 2>&1
rc=$?
dt=$(( $(date +%s) - t0 ))
if grep -q 'no CUDA device was found' "$out"; then
    if [ $rc -eq 2 ] && [ $dt -le 10 ]; then ok "kvr-run --backend cuda without a GPU: exit 2 after ${dt} s: $(grep -m 1 'no CUDA device' "$out")"
    else bad "kvr-run --backend cuda without a GPU: exit $rc after ${dt} s"; fi
elif [ $rc -eq 0 ]; then
    ok "kvr-run --backend cuda ran on a GPU"
    for r in 1 2; do
        "$build/kvr-compare" -m "$model" -p "Once upon a time, there was a little girl" --backend cuda --ranks $r -n 8 > "$out" 2>&1
        if [ $? -eq 0 ]; then ok "kvr-compare --backend cuda --ranks $r: $(grep '^logits' "$out")"; else bad "kvr-compare --backend cuda --ranks $r"; tail -n 8 "$out"; fi
    done
else
    bad "kvr-run --backend cuda: exit $rc: $(tail -n 1 "$out")"
fi
echo "cuda: $pass passed, $fail failed"
[ $fail -eq 0 ]
