#!/bin/sh
# tests/run-tests.sh BUILD [ASAN_BUILD] - run every test program of a build (and again the
# sanitizer build when given), then the end-to-end and command-line checks and the bounded fuzz
# runs. Each program prints its own "[NAME: ]N passed, M failed[, K skipped]" line (tests/check.h's
# for the C programs); this script adds them up and ends with the total.
# A test that cannot find ../shared (llama.cpp's reference outputs, the vocabularies,
# stories260K) or models/gguf (the SmolLM2 model tools/install-deps.sh fetches) says so and counts
# as skipped, never as passed; this script repeats what each one skipped under its line.

build=${1:-build}
asan=${2:-}
shared=${SHARED:-../shared}
if [ -d "$shared/reference" ]; then
    echo "shared data: $shared"
else
    echo "shared data: $shared is missing: the checks against llama.cpp's references are skipped (SHARED=DIR names another place)"
fi
smol=${KVR_SMOLLM2:-models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$smol" ] || echo "real model: $smol is missing: its checks are skipped (tools/install-deps.sh fetches it; KVR_SMOLLM2=PATH names another place)"
pass=0
fail=0
skip=0
failed_names=""
# the files outside git's view before the tests (a developer's new files): one that is new at the
# end was left in the source tree by a test (a path argument taken as a file name, a stray output)
untracked() { git status --porcelain --untracked-files=all 2> /dev/null | sed -n 's/^?? //p' | sort; }
untracked_before=$(mktemp)
untracked > "$untracked_before"

run() { # name, command...
    name=$1; shift
    out=$("$@" 2>&1)
    rc=$?
    # the last summary line; under mpirun every process prints its own (each checks what its
    # rank holds), and all of them count
    line=$(printf '%s\n' "$out" | grep -E '^[A-Za-z-]*:? ?[0-9]+ passed, [0-9]+ failed' | tail -n "${lines:-1}")
    p=$(printf '%s\n' "$line" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' | awk '{ n += $1 } END { if (NR) print n }')
    f=$(printf '%s\n' "$line" | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' | awk '{ n += $1 } END { if (NR) print n }')
    s=$(printf '%s\n' "$line" | grep -oE '[0-9]+ skipped' | grep -oE '[0-9]+' | awk '{ n += $1 } END { if (NR) print n }')
    [ -n "$p" ] || p=0
    [ -n "$f" ] || f=0
    [ -n "$s" ] || s=0
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    if [ -z "$line" ] && [ $rc -eq 0 ]; then p=1; fi
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
    if [ $rc -ne 0 ] || [ "$f" -ne 0 ]; then
        failed_names="$failed_names $name"
        printf '%s\n' "$out" | tail -n 30
        echo "FAIL $name (exit $rc)"
    else
        echo "ok   $name: $p passed${s:+, $s skipped}"
        if [ "$s" -gt 0 ]; then
            printf '%s\n' "$out" | grep -iE '^ *skip' | sed 's/^ */       /'
        fi
    fi
}

for dir in $build $asan; do
    for t in "$dir"/test-*; do
        [ -x "$t" ] || continue
        run "$t" "$t" "$shared"
    done
done

# test-ops' backend axis on the CPU backend (-b cpu): the seam every other backend is checked
# through runs on every machine, not only on those with a GPU
run "test-ops -b cpu" "$build/test-ops" -b cpu "$shared"

# the same tests on the plain reference kernels (kvr.c's "CPU kernels") instead of the fast ones:
# KVR_REF=1 puts every CPU backend on them. test-parallel runs its reduced matrix there (every
# strategy and architecture; about a minute on 2 cores, the whole one takes twice as long).
for t in test-ops test-quant test-models; do
    [ -x "$build/$t" ] && run "KVR_REF=1 $t" env KVR_REF=1 "$build/$t" "$shared"
done
[ -x "$build/test-parallel" ] && run "KVR_REF=1 test-parallel --quick" env KVR_REF=1 "$build/test-parallel" "$shared" --quick

[ -f tests/e2e.sh ] && run "e2e" sh tests/e2e.sh "$build" "$shared"
# the command-line contract of every tool: flags, ranges, paths, context, prompt files
[ -f tests/cli.sh ] && run "cli" sh tests/cli.sh "$build" "$shared"
# kvr-server end to end: curl, the openai client, malformed requests, disconnects, a load run,
# --cache-dir, SIGTERM; the sanitizer build's server too
[ -f tests/server.sh ] && run "server" sh tests/server.sh "$build" "$asan"

# kvr-compare on the CPU strategies: per-layer NMSE against one rank, --tol 0, a missing backend
[ -f tests/compare.sh ] && run "kvr-compare" sh tests/compare.sh "$build" "$shared"

# the CUDA build (make test's compile gate where nvcc is installed): the host test of the shared
# math and the attention tiles, the op cases (run on a GPU, else reported as skipped), and
# kvr-run --backend cuda (no GPU: exit 2 within 10 s saying so; a GPU: kvr-compare on it)
if [ -x "$build/cuda/test-cuda-host" ]; then
    run "cuda: test-cuda-host" "$build/cuda/test-cuda-host" "$shared"
    run "cuda: test-ops" "$build/cuda/test-ops" "$shared"
    run "cuda: kvr-run and kvr-compare" sh tests/cuda.sh "$build/cuda" "$shared"
    run "cuda: the kernels' machine code" sh tests/cuda-sass.sh "$build/cuda"
fi
# make gpu-check on a machine without a GPU: one line saying so, exit 2, at once (with a GPU, the
# probe passes and make gpu-check itself is the test)
gpu_check() {
    out=$(sh tests/gpu-check.sh run "$build/no-such-pack" 2>&1); rc=$?
    if sh tests/gpu-check.sh probe > /dev/null; then echo "a GPU is here: make gpu-check is its test"; echo "1 passed, 0 failed"; return 0; fi
    if [ $rc -eq 2 ] && echo "$out" | grep -q '^gpu-check: no NVIDIA GPU here'; then echo "$out"; echo "1 passed, 0 failed"; return 0; fi
    echo "$out"; echo "gpu-check without a GPU: exit $rc"; return 1
}
run "gpu-check without a GPU" gpu_check

# the shape of the source a reader relies on (kvr.c's contents, no pasted-file seams)
run "source checks" sh tests/check-source.sh
run "seam checks" sh tests/check-seam.sh

# the tokenizer's Unicode table is what its generator makes (it needs Unicode 15.1: Python 3.13,
# or unicodedata2; without them the check says it is skipped)
if command -v python3 > /dev/null 2>&1; then
    py="python3"
    PYENV_VERSION=3.13.0 python3 -c 'import unicodedata' > /dev/null 2>&1 && py="env PYENV_VERSION=3.13.0 python3"
    run "unicode table" $py tests/gen-unicode.py --check kvr.c
fi

# the parallel-prefill matrix again with ranks as MPI processes, when OpenMPI is installed
if [ -x "$build/mpi/test-parallel" ] && command -v mpirun > /dev/null 2>&1; then
    for np in 2 4; do
        lines=$np run "mpirun -np $np test-parallel --mpi" timeout 600 mpirun --allow-run-as-root --oversubscribe -np $np \
            "$build/mpi/test-parallel" "$shared" --mpi
    done
    unset lines
else
    echo "skip MPI tests (no MPI build or no mpirun)"
    skip=$((skip + 1))
fi

# the GGUF loader under libFuzzer for a bounded time, seeded with test-gguf's corpus
if [ -x "$build/fuzz-gguf" ] && [ -x "$build/test-gguf" ]; then
    mkdir -p "$build/fuzz-corpus"
    "$build/test-gguf" --write-corpus "$build/fuzz-corpus" > /dev/null 2>&1
    run "fuzz-gguf (${FUZZ_SECONDS:-30} s)" "$build/fuzz-gguf" -max_total_time="${FUZZ_SECONDS:-30}" -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$build/" "$build/fuzz-corpus"
fi

# the KV cache file's and the replication log's readers under libFuzzer for a bounded time, seeded
# with files the library writes (the target writes them into the corpus first)
if [ -x "$build/fuzz-kvfile" ] && [ -f "$shared/models/stories260K.gguf" ]; then
    mkdir -p "$build/fuzz-kv-corpus"
    run "fuzz-kvfile (${FUZZ_SECONDS:-30} s)" env KVR_FUZZ_MODEL="$shared/models/stories260K.gguf" KVR_FUZZ_KV_SEEDS="$build/fuzz-kv-corpus" \
        "$build/fuzz-kvfile" -max_total_time="${FUZZ_SECONDS:-30}" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$build/fuzz-kvfile-" "$build/fuzz-kv-corpus"
elif [ -x "$build/fuzz-kvfile" ]; then
    echo "skip fuzz-kvfile (no $shared/models/stories260K.gguf)"
    skip=$((skip + 1))
fi

# kvr-run's command line under libFuzzer for a bounded time, with the stall hook among its inputs
# (a hang past -timeout is a failure), seeded with a value of each kind for every flag
if [ -x "$build/fuzz-cli" ] && [ -f "$shared/models/stories260K.gguf" ]; then
    rm -rf "$build/fuzz-cli-corpus"
    mkdir -p "$build/fuzz-cli-corpus"
    run "fuzz-cli (${FUZZ_SECONDS:-30} s)" env KVR_FUZZ_MODEL="$shared/models/stories260K.gguf" KVR_FUZZ_CLI_SEEDS="$build/fuzz-cli-corpus" \
        "$build/fuzz-cli" -max_total_time="${FUZZ_SECONDS:-30}" -timeout=60 -rss_limit_mb=4096 -close_fd_mask=3 \
        -artifact_prefix="$build/fuzz-cli-" "$build/fuzz-cli-corpus"
elif [ -x "$build/fuzz-cli" ]; then
    echo "skip fuzz-cli (no $shared/models/stories260K.gguf)"
    skip=$((skip + 1))
fi

left=$(untracked | comm -13 "$untracked_before" -)
rm -f "$untracked_before"
if [ -n "$left" ]; then
    fail=$((fail + 1))
    echo "FAIL the tests left files in the source tree: $(printf '%s\n' "$left" | head -n 5 | tr '\n' ' ')"
else
    pass=$((pass + 1))
    echo "ok   the tests left no file in the source tree"
fi

echo "$pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ]
