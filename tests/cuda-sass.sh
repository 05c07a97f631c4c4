#!/bin/sh
# tests/cuda-sass.sh CUDA_BUILD - what the CUDA kernels really compile to, read without a GPU from
# the machine code (SASS) in CUDA_BUILD/kvr-cuda.o and ptxas's report beside it:
#  - every instance of the tensor-core prefill attention (k_fattn<D>) on every architecture built
#    (sm_80, sm_90) issues HMMA with F32 accumulation: its WMMA tiles became tensor-core
#    instructions, not a scalar fallback;
#  - the kernels on the hot paths (k_fattn, k_fdec, k_dot8, k_mul_mat_id, k_attn, k_dequant_f32)
#    touch no local memory (LDL/STL: an array the compiler could not keep in registers, or spills);
#  - ptxas reports no spills in any kernel.
# cuobjdump and nvdisasm come with the CUDA toolkit; where the toolkit lacks them,
# tools/install-deps.sh puts NVIDIA's PyPI builds of the two in build/cuda-bin. Without them the
# checks are skipped, saying so. The per-kernel counts go to CUDA_BUILD/kvr-cuda.sass.txt.
# Ends with "N passed, M failed[, K skipped]".
build=${1:-build/cuda}
obj=$build/kvr-cuda.o
report=$build/kvr-cuda.ptxas
pass=0; fail=0; skip=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }

if [ ! -f "$obj" ]; then
    echo "cuda-sass: no $obj (the CUDA build is made by make test where nvcc is installed)"
    echo "0 passed, 0 failed, 1 skipped"; exit 0
fi
dump=""
for c in "${CUOBJDUMP:-}" "$(command -v cuobjdump 2>/dev/null)" "$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent/nvcc)")/cuobjdump" \
         "$(dirname "$build")/cuda-bin/cuobjdump" build/cuda-bin/cuobjdump; do
    if [ -n "$c" ] && [ -x "$c" ]; then dump=$c; break; fi
done
if [ -z "$dump" ]; then
    echo "cuda-sass: cuobjdump is not installed (tools/install-deps.sh fetches it into build/cuda-bin): the SASS checks are skipped"
    echo "0 passed, 0 failed, 1 skipped"; exit 0
fi
# cuobjdump runs nvdisasm from the PATH
PATH=$(dirname "$dump"):$PATH
export PATH
sass=$(mktemp)
trap 'rm -f "$sass"' EXIT
if ! "$dump" -sass "$obj" > "$sass" 2>&1; then
    bad "cuobjdump -sass $obj: $(tail -n 1 "$sass")"
    echo "$pass passed, $fail failed"; exit 1
fi

# one line per (architecture, kernel, opcode): count arch kernel opcode (predicates and
# modifiers stripped: "@P0 HMMA.16816.F32 ..." counts as HMMA; F32-accumulating HMMA as HMMA.F32)
counts=$build/kvr-cuda.sass.txt
awk '/code for sm_/ { arch = $NF; next }
     /Function :/ { fn = $NF; next }
     $1 ~ /^\/\*[0-9a-f]+\*\/$/ {
         op = $2; if (op ~ /^@/) op = $3
         full = op; sub(/;$/, "", full); sub(/\..*/, "", op)
         n[arch " " fn " " op]++
         if (op == "HMMA" && full ~ /\.F32$/) n[arch " " fn " HMMA.F32"]++
     }
     END { for (k in n) print n[k], k }' "$sass" | sort -k2,3 > "$counts"
archs=$(awk '{ print $2 }' "$counts" | sort -u)
[ -n "$archs" ] || { bad "no machine code for any architecture in $obj"; echo "$pass passed, $fail failed"; exit 1; }

for a in $archs; do
    fattn=$(awk -v a="$a" '$2 == a && $3 ~ /k_fattn/ { print $3 }' "$counts" | sort -u)
    if [ -z "$fattn" ]; then bad "$a: no k_fattn instance in the machine code"; continue; fi
    for f in $fattn; do
        name=$(echo "$f" | c++filt 2>/dev/null || echo "$f")
        h=$(awk -v a="$a" -v f="$f" '$2 == a && $3 == f && $4 == "HMMA.F32" { print $1 }' "$counts")
        if [ -n "$h" ] && [ "$h" -gt 0 ]; then ok "$a $name: $h HMMA with F32 accumulation (tensor cores)"
        else bad "$a $name: no HMMA with F32 accumulation: the tiles did not become tensor-core instructions"; fi
    done
    for k in k_fattn k_fdec k_dot8 k_mul_mat_id k_attn k_dequant_f32; do
        fns=$(awk -v a="$a" -v k="$k" '$2 == a && index($3, k) { print $3 }' "$counts" | sort -u)
        [ -n "$fns" ] || { bad "$a: no $k in the machine code"; continue; }
        nf=$(echo "$fns" | wc -l)
        local_ops=$(awk -v a="$a" -v k="$k" '$2 == a && index($3, k) && ($4 == "LDL" || $4 == "STL") { s += $1 } END { print s + 0 }' "$counts")
        if [ "$local_ops" -eq 0 ]; then ok "$a $k ($nf instances): no local memory"
        else bad "$a $k: $local_ops local-memory instructions (LDL/STL): $(awk -v a="$a" -v k="$k" '$2 == a && index($3, k) && ($4 == "LDL" || $4 == "STL") { print $3 }' "$counts" | sort -u | c++filt | tr '\n' ' ')"; fi
    done
done
if [ -f "$report" ]; then
    spills=$(awk '/Compiling entry function/ { f = $(NF-2) " " $NF } /bytes spill stores/ && ($5 > 0 || $9 > 0) { print f ": " $0 }' "$report")
    if [ -z "$spills" ]; then ok "ptxas: no kernel spills registers ($(grep -c 'Compiling entry function' "$report") kernel builds)"
    else bad "ptxas: spills: $spills"; fi
else
    skip=$((skip + 1)); echo "skip no ptxas report $report"
fi
others=$(awk '($4 == "LDL" || $4 == "STL") { print $2 " " $3 }' "$counts" | sort -u | c++filt | sed 's/(.*//' | sort -u | tr '\n' ';')
[ -z "$others" ] || echo "note: kernels with local memory (small per-thread arrays off the hot paths): $others"
echo "$pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ]
