# tests/bench-pair.sh - sourced by tests/bench-matrix.sh and tests/bench.sh: one benchmark point
# timed by kvr-bench and by llama.cpp's llama-bench on the same file, the two runs alternating
# (kvr, llama.cpp, kvr, llama.cpp, ...) so that a change in the machine's load falls on both, and
# the median of each side. A point is a figure as llama-bench names it:
#   ppN       prefill of an N-token prompt into an empty cache
#   tgN@dD    N decode steps after a D-token prompt (kvr-bench --ctx D --decode N; llama-bench
#             -p 0 -n N -d D, whose depth is prefilled untimed, as kvr-bench's prompt is)
# Both tools run with their default flags apart from the threads: kvr's F16 cache against
# llama.cpp's F16 cache (its -ctk/-ctv default), llama.cpp's flash attention on its default (auto),
# its default batch sizes; each run is one process (its model load untimed, one untimed warm-up of
# the same point: kvr-bench --warmup 1, llama-bench's own warm-up).
# The caller sets: build (kvr's build directory), lb (llama-bench, empty for none), pair_threads,
# pair_log (where llama-bench's errors go).
# shellcheck disable=SC2154 # build, pair_threads, pair_log: the caller's

# the middle of the numbers on stdin (the mean of the two middle ones for an even count); "-" for none
pair_median() {
    sort -g | awk '{ v[++n] = $1 } END { if (!n) print "-"; else if (n % 2) print v[(n + 1) / 2]; else print (v[n / 2] + v[n / 2 + 1]) / 2 }'
}

# kvr-bench once: tok/s of the point, nothing if it failed
pair_kvr_once() { # MODEL FIGURE [kvr-bench flags...]
    m=$1; f=$2; shift 2
    case $f in
        pp*) "$build/kvr-bench" -m "$m" --ctx "${f#pp}" -t "$pair_threads" -r 1 -o csv "$@" 2>/dev/null < /dev/null |
                 awk -F, 'NR == 2 { print $11 }' ;;
        tg*) n=${f#tg}; "$build/kvr-bench" -m "$m" --ctx "${n#*@d}" --decode "${n%@d*}" -t "$pair_threads" -r 1 -o csv "$@" \
                 2>/dev/null < /dev/null | awk -F, 'NR == 2 { print $16 }' ;;
    esac
}

# llama-bench once: tok/s of the point (its JSON-lines "avg_ts" of one repetition), nothing if it
# failed (its messages and its exit status appended to $pair_log: a file it refuses, or a build
# that dies on this CPU, shows there)
pair_llama_once() { # MODEL FIGURE
    case $2 in
        pp*) set -- "$1" "$2" -p "${2#pp}" -n 0 ;;
        tg*) n=${2#tg}; set -- "$1" "$2" -p 0 -n "${n%@d*}" -d "${n#*@d}" ;;
    esac
    m=$1; f=$2; shift 2
    pair_out=${pair_log%.log}.out
    if "$lb" -m "$m" -t "$pair_threads" "$@" -r 1 -o jsonl > "$pair_out" 2>> "$pair_log" < /dev/null; then
        sed -n 's/.*"avg_ts": *\([0-9.eE+-]*\).*/\1/p' "$pair_out"
    else
        echo "llama-bench failed (exit status $?) on $m, $f" >> "$pair_log"
    fi
}

# RUNS alternating pairs of one point: prints "kvr_median llama_median" ("-" where a side did not
# run or failed every time)
pair_point() { # MODEL FIGURE RUNS [kvr-bench flags...]
    pm=$1; pf=$2; pr=$3; shift 3
    pk=; pl=; pi=0
    while [ $pi -lt "$pr" ]; do
        pk="$pk $(pair_kvr_once "$pm" "$pf" "$@")"
        [ -n "$lb" ] && pl="$pl $(pair_llama_once "$pm" "$pf")"
        pi=$((pi + 1))
    done
    echo "$(echo "$pk" | tr ' ' '\n' | grep . | pair_median) $(echo "$pl" | tr ' ' '\n' | grep . | pair_median)"
}

# one table row: "| LABEL | FIGURE | kvr | llama.cpp | ratio |" from pair_point's two medians
pair_row() { # LABEL FIGURE KVR LLAMA
    awk -v m="$1" -v f="$2" -v k="$3" -v l="$4" 'BEGIN {
        kv = k == "-" ? "-" : sprintf("%.1f", k); lv = l == "-" ? "-" : sprintf("%.1f", l)
        r = (k != "-" && l != "-" && l + 0 > 0) ? sprintf("%.2fx", k / l) : "-"
        printf "| %s | %s | %s | %s | %s |\n", m, f, kv, lv, r }'
}
