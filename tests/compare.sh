#!/bin/sh
# tests/compare.sh BUILD SHARED - tools/kvr-compare on the CPU strategies: every strategy on 2 and
# 3 ranks against one rank must print the per-layer NMSE of the intermediates and pass (exit 0)
# with the default tolerance; with --tol 0 it must fail (exit 1) exactly when it measured a
# difference of the logits. A CUDA build's kvr-compare --backend cuda is checked by tests/cuda.sh.
# Ends with "N passed, M failed".
build=${1:-build}
shared=${2:-../shared}
pass=0; fail=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

model=$shared/models/stories260K.gguf
if [ ! -f "$model" ]; then
    model=$tmp/tiny.gguf
    "$build/kvr-gen" --preset tiny --layers 2 --seed 1 -q -o "$model" || { echo "cannot make a model"; exit 1; }
fi
cmp="$build/kvr-compare -m $model -p 'Once upon a time, there was a little girl named Lily. She loved to play' -t 1"

# the issue's own example first, then the other strategies
for case in "kvr 3" "kvr 2" "tsp 3" "ring-kv 2" "ring-kv 3" "ring-q 3"; do
    set -- $case
    eval "$cmp --strategy $1 --ranks $2 -n 4" > "$tmp/out" 2>&1
    rc=$?
    layers=$(grep -cE '^[0-9]+ +(attn|out) ' "$tmp/out")
    if [ $rc -eq 0 ] && [ "$layers" -gt 0 ] && grep -q '^kvr-compare: PASS' "$tmp/out" && grep -q 'greedy top-1: 5 of 5 agree' "$tmp/out"; then
        ok "kvr-compare --strategy $1 --ranks $2: $layers NMSE lines, $(grep '^logits' "$tmp/out" | sed 's/ (tolerance.*//')"
    else
        bad "kvr-compare --strategy $1 --ranks $2: exit $rc, $layers NMSE lines"; tail -n 5 "$tmp/out"
    fi
    # --tol 0: exit 1 exactly when a difference of the logits was measured
    eval "$cmp --strategy $1 --ranks $2 -n 0 --tol 0" > "$tmp/out0" 2>&1
    rc0=$?
    d=$(sed -n 's/^logits of the last prompt token: max |diff| \([^ ]*\) .*/\1/p' "$tmp/out0")
    want=$(awk -v d="$d" 'BEGIN { print (d == "" ? -1 : (d + 0 > 0 ? 1 : 0)) }')
    if [ "$want" -ge 0 ] && [ $rc0 -eq "$want" ]; then ok "--tol 0 with $1 on $2 ranks: max |diff| $d, exit $rc0"; else bad "--tol 0 with $1 on $2 ranks: max |diff| '$d', exit $rc0"; fi
done

# the reference against itself measures nothing: exit 0 even with --tol 0
eval "$cmp -n 2 --tol 0" > "$tmp/out" 2>&1
if [ $? -eq 0 ] && grep -q 'max |diff| 0.000e+00' "$tmp/out" && grep -q 'worst NMSE 0.000e+00' "$tmp/out"; then ok "one rank against itself: no difference, exit 0"; else bad "one rank against itself"; tail -n 5 "$tmp/out"; fi

# a backend that is not there: exit 2 and the reason
"$build/kvr-compare" -m "$model" -p hi --backend cuda > "$tmp/out" 2>&1
rc=$?
if [ $rc -eq 2 ] && grep -qE 'built without CUDA|no CUDA device was found' "$tmp/out"; then ok "--backend cuda without a device or a CUDA build: exit 2, $(grep -oE 'built without CUDA|no CUDA device was found' "$tmp/out" | head -n 1)"
elif [ $rc -eq 0 ]; then ok "--backend cuda ran on a device and passed"
else bad "--backend cuda: exit $rc: $(tail -n 1 "$tmp/out")"; fi

echo "compare: $pass passed, $fail failed"
[ $fail -eq 0 ]
