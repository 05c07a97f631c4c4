#!/bin/sh
# tests/check-seam.sh - the backend seam holds in the source: outside backend code nothing reads
# or writes a tensor's data (the address may be device memory; inputs go in with
# kvr_backend_tensor_set, outputs come out with kvr_backend_tensor_get), kvr-comm.c does not know
# which backend runs a rank, and one road runs every eval: a session's ranks (one by default) each
# through kvr_eval_run.
# Prints one "N passed, M failed" line like every test program.
#
# The fence in kvr.c is its numbered section banners. Code that may use ->data:
#   tensors and contexts, graphs       the allocator: host tensors, views, placement in a buffer
#   backends                           the seam itself: host copies, what a transport is handed
#   CPU kernels, CPU backend           the CPU backend
#   GGUF reader, GGUF writer,          their ->data are fields of the GGUF structs (struct
#   tokenizers                         kvr_gguf_kv, kvr_gguf_tensor, the writer's entries), not tensors
# Every other section of kvr.c (a new one too), all of kvr-comm.c, models/ and tools/ are checked,
# except GGUF metadata read where it is named as everywhere: kv->data (a struct kvr_gguf_kv from
# kvr_gguf_get_kv; recipes read arrays of metadata). Tests and kvr-tune.c's calibration build host
# tensors (no_alloc = false contexts, no backend) and are not checked.
pass=0
fail=0
check() { # description, then a command that succeeds when the check holds
    d=$1; shift
    if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $d"; fi
}

# file:line: text of every use of a ->data field (not ->data_offset and the like)
data_uses() {
    grep -nE -- '->data([^_a-zA-Z0-9]|$)' "$@" /dev/null | grep -vE -- '[^_a-zA-Z0-9]kv->data([^_a-zA-Z0-9]|$)'
}

# the same for kvr.c outside the fence; each line names its section
kvr_c_uses() {
    awk 'prev == "//" && /^\/\/ [0-9]+\. / { sec = $0; sub(/^\/\/ [0-9]+\. /, "", sec) }
         { prev = $0 }
         /->data([^_a-zA-Z0-9]|$)/ && !/[^_a-zA-Z0-9]kv->data([^_a-zA-Z0-9]|$)/ {
             if (sec ~ /^(tensors and contexts|graphs|backends|CPU kernels|CPU backend|GGUF reader|GGUF writer|tokenizers)/) next
             s = sec; sub(/[:.].*/, "", s)
             print "kvr.c:" NR ": (section " s ") " $0
         }' kvr.c
}

out=$(data_uses kvr-comm.c models/*.c tools/*.c)
check "kvr-comm.c, models/ and tools/ use no tensor's data" [ -z "$out" ]
[ -z "$out" ] || printf '%s\n' "$out"
out=$(kvr_c_uses)
check "kvr.c's sections outside the backend fence use no tensor's data" [ -z "$out" ]
[ -z "$out" ] || printf '%s\n' "$out"
# the fence is there: the sections it names exist (a renamed banner must not open it silently)
for s in "tensors and contexts" "graphs" "backends" "CPU kernels" "CPU backend" "GGUF reader" "GGUF writer" "tokenizers" "eval road"; do
    check "kvr.c has a section '$s'" grep -qE "^// [0-9]+\. $s" kvr.c
done

out=$(grep -n 'kvr_backend_cpu_\|struct cpu_backend' kvr-comm.c)
check "kvr-comm.c names no CPU-backend function or type" [ -z "$out" ]
[ -z "$out" ] || printf '%s\n' "$out"
out=$(awk 'prev == "//" && /^\/\/ [0-9]+\. / { sec = $0 } { prev = $0 }
           /struct cpu_backend/ && sec !~ /CPU backend/ { print "kvr.c:" NR ": " $0 }' kvr.c)
check "only the CPU backend's section knows its context (struct cpu_backend)" [ -z "$out" ]
[ -z "$out" ] || printf '%s\n' "$out"

# one eval road: ranks build, plan and run their graphs only through kvr_eval_run
out=$(grep -nE '(kvr_model_build|kvr_graph_plan|kvr_graph_place|kvr_backend_graph_compute) *\(' kvr-comm.c)
check "kvr-comm.c builds, plans and runs no graph itself (it calls kvr_eval_run)" [ -z "$out" ]
[ -z "$out" ] || printf '%s\n' "$out"
check "kvr-comm.c runs a rank through kvr_eval_run" grep -q 'kvr_eval_run(' kvr-comm.c
n=$(grep -c 'kvr_model_build(' kvr.c)
# its definition and the eval road's call
check "kvr.c builds a model's graph in one place, the eval road (kvr_model_build appears twice, found $n)" [ "$n" -eq 2 ]
# one front door: the session is kvr-comm.c's; kvr.c has no second one
check "kvr_session_eval is defined in kvr-comm.c and nowhere else" \
    sh -c "grep -q '^const float \* kvr_session_eval(' kvr-comm.c && ! grep -q '^const float \* kvr_session_eval(' kvr.c"

echo "check-seam: $pass passed, $fail failed"
[ $fail -eq 0 ]
