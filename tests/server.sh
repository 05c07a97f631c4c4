#!/bin/sh
# tests/server.sh BUILD [ASAN_BUILD] - kvr-server end to end on SmolLM2: servers started on free
# ports (--port 0: the kernel picks, the server prints it) and stopped by the test; curl and
# tests/server-client.py (the Python standard library, and OpenAI's openai package from PyPI in a
# venv made once in BUILD/server-venv; skipped, saying so, where PyPI cannot be reached) drive them.
# The greedy texts they expect are kvr-run's for the same turns, made first. Then a server with
# --cache-dir (an idle slot swapped out to a file and back, the answer unchanged), SIGTERM while a
# stream runs (it ends whole, the server exits 0), --ranks (a prompt prefilled on 2 ranks and handed
# to a slot, answering as kvr-run on 2 ranks) and, where ASAN_BUILD has kvr-server, a short session
# against the sanitizer build. Every wait is bounded (timeout, curl --max-time).

build=${1:-build}
asan=${2:-}
smol=${KVR_SMOLLM2:-models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}
pass=0
fail=0
skip=0
ok()   { pass=$((pass + 1)); echo "ok   $*"; }
bad()  { fail=$((fail + 1)); echo "FAIL $*"; }
skp()  { skip=$((skip + 1)); echo "SKIP $*"; }
summary() { echo "server: $pass passed, $fail failed, $skip skipped"; [ "$fail" -eq 0 ]; exit $?; }

if [ ! -x "$build/kvr-server" ]; then
    skp "kvr-server is not built (libmicrohttpd-dev and libjansson-dev: tools/install-deps.sh)"
    summary
fi
if [ ! -f "$smol" ]; then
    skp "kvr-server: $smol is not there (tools/install-deps.sh fetches it)"
    summary
fi
command -v curl > /dev/null || { skp "kvr-server: curl is not installed"; summary; }

tmp=$(mktemp -d)
pids=""
cleanup() {
    for p in $pids; do kill "$p" 2> /dev/null; done
    rm -rf "$tmp"
}
trap cleanup EXIT INT TERM

# start_server NAME BINARY ARGS...: sets $url and $pid, or returns 1 (its stderr is $tmp/NAME.err)
start_server() {
    name=$1; bin=$2; shift 2
    "$bin" -m "$smol" --port 0 "$@" > "$tmp/$name.out" 2> "$tmp/$name.err" &
    pid=$!
    pids="$pids $pid"
    i=0
    while [ $i -lt 600 ]; do # a sanitizer build loads slowly: up to 60 s
        line=$(sed -n 's/^listening on //p' "$tmp/$name.out" 2> /dev/null) # the file may not be made yet
        if [ -n "$line" ]; then url="http://$line"; return 0; fi
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.1
        i=$((i + 1))
    done
    cat "$tmp/$name.err"
    return 1
}

# stop_server PID SECONDS: SIGTERM, then its exit status (124 when it did not exit in time)
stop_server() {
    kill -TERM "$1" 2> /dev/null
    i=0
    while kill -0 "$1" 2> /dev/null && [ $i -lt $(($2 * 10)) ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 "$1" 2> /dev/null; then kill -KILL "$1"; wait "$1" 2> /dev/null; return 124; fi
    wait "$1"
}

# what kvr-run answers, greedy, for the turns the client sends (the same threads as the server, and
# the same arithmetic: 8-bit activations, the default of both)
threads=2
python3 - "$build" "$smol" "$threads" > "$tmp/expected.json" <<'PY' || { bad "kvr-run's reference answers"; summary; }
import json, subprocess, sys
build, model, threads = sys.argv[1:]
def run(args):
    r = subprocess.run([build + "/kvr-run", "-m", model, "--temp", "0", "-t", threads, "-c", "2048"] + args,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    if r.returncode != 0:
        sys.exit("kvr-run %s: %s" % (args, r.stderr.decode()[-500:]))
    return r.stdout.decode()
def chat(q, n):
    out = run(["-cnv", "-p", q, "-n", str(n)])
    assert out.endswith("\n")
    return {"q": q, "n": n, "text": out[:-1]}
exp = {"chat": [chat("What is the capital of France?", 24), chat("Write one sentence about cats.", 32)]}
prompt = "The capital of France is"
text = run(["-p", prompt, "-n", "16"])
assert text.startswith(prompt)
text = text[len(prompt):]
words = text.split()
exp["completion"] = {"prompt": prompt, "n": 16, "text": text, "stop": words[1] if len(words) > 2 else text[2:4]}
topics = ["the moon", "bread", "a river", "winter", "music", "trees", "the ocean", "a city"]
exp["concurrent"] = [chat("Tell me one fact about %s." % t, 16) for t in topics]
q = ("Here is a note: the old lighthouse keeper wrote in his log that the ship passed the rocks at dawn, carrying wool, "
     "salt and letters to the northern island. The weather was calm and the sea was grey. What did the ship carry?")
exp["ranks"] = {"q": q, "n": 24, "text": run(["-cnv", "-p", q, "-n", "24", "--ranks", "2", "--strategy", "kvr"])[:-1]}
exp["document"] = " ".join("Part %d: the old lighthouse keeper wrote in his log that the ship number %d passed "
                           "the rocks at dawn, carrying wool, salt and letters to the northern island." % (i, i * 7 % 31)
                           for i in range(12))
json.dump(exp, sys.stdout)
PY
ok "kvr-run's reference answers"

# the venv with OpenAI's client (made once; a later run reuses it)
py=python3
venv="$build/server-venv"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import openai" 2> /dev/null; then
    py="$venv/bin/python"
else
    rm -rf "$venv"
    if timeout 120 python3 -m venv "$venv" > "$tmp/venv.log" 2>&1 &&
       timeout 300 "$venv/bin/pip" install --disable-pip-version-check -q openai >> "$tmp/venv.log" 2>&1; then
        py="$venv/bin/python"
    else
        rm -rf "$venv"
        echo "SKIP the openai package: PyPI could not be reached or the venv not made ($(tail -n 1 "$tmp/venv.log")); the standard-library checks run alone"
    fi
fi

# 1. the main server: every check of server-client.py, with an API key
if start_server main "$build/kvr-server" -np 4 -c 2048 -t $threads --api-key sekret; then
    ok "kvr-server started ($url)"
    h=$(curl -s --max-time 10 "$url/health")
    [ "$h" = '{"status":"ok"}' ] && ok "curl /health: $h" || bad "curl /health: $h"
    code=$(curl -s --max-time 10 -o "$tmp/r.json" -w '%{http_code}' "$url/v1/models")
    [ "$code" = 401 ] && grep -q '"error"' "$tmp/r.json" && ok "curl /v1/models without the key: 401" || bad "curl /v1/models without the key: $code"
    code=$(curl -s --max-time 60 -o "$tmp/r.json" -w '%{http_code}' -H 'Authorization: Bearer sekret' "$url/v1/chat/completions" \
           -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"temperature":0,"max_tokens":24}')
    want=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["chat"][0]["text"])' "$tmp/expected.json")
    got=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"])' "$tmp/r.json" 2> /dev/null)
    [ "$code" = 200 ] && [ "$got" = "$want" ] && ok "curl chat completion equals kvr-run -cnv" || bad "curl chat completion: $code '$got' vs '$want'"
    curl -s -N --max-time 60 -H 'Authorization: Bearer sekret' "$url/v1/completions" \
         -d '{"prompt":"The capital of France is","temperature":0,"max_tokens":16,"stream":true}' > "$tmp/sse.txt"
    tail -n 2 "$tmp/sse.txt" | grep -q '^data: \[DONE\]' && grep -c '^data: ' "$tmp/sse.txt" | grep -qv '^[0-2]$' \
        && ok "curl SSE stream: $(grep -c '^data: ' "$tmp/sse.txt") events, [DONE] last" || bad "curl SSE stream: $(tail -c 300 "$tmp/sse.txt")"
    out=$(timeout 600 "$py" tests/server-client.py "$url" "$pid" "$tmp/expected.json" --api-key sekret 2>&1)
    echo "$out" | grep -E '^(ok|FAIL|SKIP) '
    line=$(echo "$out" | tail -n 1)
    p=$(echo "$line" | sed -n 's/^\([0-9]*\) passed.*/\1/p'); f=$(echo "$line" | sed -n 's/.* \([0-9]*\) failed.*/\1/p')
    s=$(echo "$line" | sed -n 's/.* \([0-9]*\) skipped.*/\1/p')
    if [ -z "$p" ]; then echo "$out" | tail -n 20; bad "server-client.py did not finish"; else
        pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s)); fi
    curl -s --max-time 10 "$url/metrics" > "$tmp/metrics.txt"
    for k in kvr_requests_total kvr_prompt_tokens_total kvr_generated_tokens_total kvr_time_to_first_token_seconds_count kvr_queue_depth kvr_cache_tokens; do
        grep -q "^$k " "$tmp/metrics.txt" && ok "metrics: $(grep "^$k " "$tmp/metrics.txt")" || bad "metrics: no $k"
    done
    # SIGTERM while a stream runs: the stream ends whole, the server exits 0
    curl -s -N --max-time 120 -H 'Authorization: Bearer sekret' "$url/v1/completions" \
         -d '{"prompt":"Once upon a time","temperature":0,"max_tokens":48,"stream":true}' > "$tmp/drain.txt" &
    cpid=$!
    sleep 0.5
    stop_server "$pid" 60
    rc=$?
    wait $cpid
    [ $rc -eq 0 ] && ok "SIGTERM: the server drained and exited 0" || bad "SIGTERM: exit status $rc"
    tail -n 2 "$tmp/drain.txt" | grep -q '^data: \[DONE\]' && ok "SIGTERM: the running stream ended whole ([DONE])" \
        || bad "SIGTERM: the running stream was cut: $(tail -c 200 "$tmp/drain.txt")"
else
    bad "kvr-server did not start"
fi

# 2. --cache-dir: an idle slot's cache goes to a file and comes back for the follow-up
mkdir -p "$tmp/cache"
if start_server cache "$build/kvr-server" -np 2 -c 2048 -t $threads --cache-dir "$tmp/cache" --swap-idle 1; then
    body='{"messages":[{"role":"user","content":"What is the capital of France?"}],"temperature":0,"max_tokens":24}'
    curl -s --max-time 60 "$url/v1/chat/completions" -d "$body" > "$tmp/c1.json"
    i=0
    while [ $i -lt 100 ] && ! ls "$tmp/cache" | grep -q 'kvc$'; do sleep 0.1; i=$((i + 1)); done
    ls "$tmp/cache" | grep -q 'kvc$' && ok "--cache-dir: the idle slot swapped out to $(ls "$tmp/cache")" || bad "--cache-dir: nothing swapped out"
    curl -s --max-time 60 "$url/v1/chat/completions" -d "$body" > "$tmp/c2.json"
    python3 - "$tmp/c1.json" "$tmp/c2.json" <<'PY' && ok "--cache-dir: the follow-up from the swapped cache gives the same answer" || bad "--cache-dir: answers differ"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], (a, b)
# all of it but a last piece that takes the prefill kernels (KVR_ROW_TOKENS + 1 = 5 tokens with
# 8-bit activations: see kvr-server's prefill_piece), so that the bits are a one-piece prefill's
assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == b["usage"]["prompt_tokens"] - 5, b["usage"]
PY
    curl -s --max-time 10 "$url/metrics" | grep -q '^kvr_swaps_total{dir="in"} [1-9]' && ok "--cache-dir: swapped back in" || bad "--cache-dir: no swap in counted"
    stop_server "$pid" 30 && ok "--cache-dir server: exit 0" || bad "--cache-dir server: exit $?"
else
    bad "kvr-server --cache-dir did not start"
fi

# 3. --ranks: a long prompt prefilled on 2 local ranks (KV-Runahead) and its cache handed to a slot
if start_server ranks "$build/kvr-server" -np 2 -c 2048 -t $threads --ranks 2 --strategy kvr --ranks-min 32; then
    python3 - "$url" "$tmp/expected.json" <<'PY' && ok "--ranks 2 --strategy kvr: the handed-over prefill answers as kvr-run -cnv --ranks 2 --strategy kvr" || bad "--ranks: answer differs"
import json, sys, urllib.request
url, exp = sys.argv[1], json.load(open(sys.argv[2]))["ranks"]
req = urllib.request.Request(url + "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": exp["q"]}],
                             "temperature": 0, "max_tokens": exp["n"]}).encode(), {"Content-Type": "application/json"})
got = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]["content"]
assert got == exp["text"], (got, exp["text"])
PY
    curl -s --max-time 10 "$url/metrics" | grep -q '^kvr_handoffs_total 1$' && ok "--ranks: one hand-off counted" || bad "--ranks: no hand-off counted"
    stop_server "$pid" 30 && ok "--ranks server: exit 0" || bad "--ranks server: exit $?"
else
    bad "kvr-server --ranks did not start"
fi

# 4. the sanitizer build: malformed requests, one greedy chat, a disconnect
if [ -n "$asan" ] && [ -x "$asan/kvr-server" ]; then
    if start_server asan "$asan/kvr-server" -np 2 -c 2048 -t $threads; then
        out=$(QUICK=1 timeout 600 python3 tests/server-client.py "$url" "$pid" "$tmp/expected.json" 2>&1)
        line=$(echo "$out" | tail -n 1)
        echo "$line" | grep -q ' 0 failed' && ok "ASan+UBSan server: $line" || { echo "$out" | grep FAIL; bad "ASan+UBSan server: $line"; }
        stop_server "$pid" 60
        rc=$?
        if [ $rc -eq 0 ] && ! grep -q 'Sanitizer' "$tmp/asan.err"; then ok "ASan+UBSan server: clean exit"; else
            grep -A 20 'Sanitizer' "$tmp/asan.err" | head -n 40; bad "ASan+UBSan server: exit $rc"; fi
    else
        bad "the ASan+UBSan kvr-server did not start"
    fi
elif [ -n "$asan" ]; then
    skp "the ASan+UBSan kvr-server is not built"
fi
summary
