#!/usr/bin/env python3
# tools/server-bench.py - kvr-server's figures (make bench runs it): the aggregate decode rate at
# 1, 2, 4 and 8 concurrent streams (one server, --parallel 8), and the time to first token of a
# follow-up question over a long document with and without the prompt cache (a server of one slot:
# "without" is the same follow-up after another request took the slot). Beside each, llama-server
# (on the PATH, or at --llama-server) run the same way. Standard library only.
#
# The two servers get the same model, threads, slots and context per slot, and greedy requests
# (temperature 0) through the same OpenAI endpoints. llama-server's -c is the context of all its
# slots together, so it gets slots x the per-slot context, with a KV buffer of its own per slot
# (--no-kv-unified, as kvr-server's slots have); both KV caches are F16, their defaults. Its host-
# memory prompt cache (--cache-ram, which would bring a displaced slot's state back) is off, as
# kvr-server's --cache-dir is: both keep a prompt only in the slot that ran it (llama-server's
# cache_prompt, on by default, as kvr-server's longest-prefix reuse). Each request asks for its
# usage, and the TTFT table prints how many of the follow-up's prompt tokens each server found
# cached, so a "no cache" figure that was not one shows.
#
#   server-bench.py BUILD [MODEL.gguf] [--threads N] [--doc-tokens N] [--tokens N] [--streams 1,2,4,8]
#                   [--rounds 3] [--ctx 4096] [--llama-server PATH|none] [--kvr-args=ARGS] [--out FILE.md]

import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("model", nargs="?", default="models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--doc-tokens", type=int, default=2048, help="about how long the document of the TTFT pair is")
ap.add_argument("--tokens", type=int, default=32, help="tokens each stream generates")
ap.add_argument("--streams", default="1,2,4,8", help="concurrent stream counts; the server has the largest as slots")
ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the stream counts; the best of each is kept")
ap.add_argument("--ctx", type=int, default=4096, help="context of each slot in tokens")
ap.add_argument("--llama-server", default=None, help="llama-server to run beside (default: the one on the PATH; none: skip)")
ap.add_argument("--kvr-args", default="", help="more kvr-server arguments, one string (e.g. --kvr-args=--exact)")
ap.add_argument("--out", default=None)
a = ap.parse_args()
if not os.path.exists(a.model):
    print("server-bench: %s is not there (tools/install-deps.sh fetches it): skipped" % a.model)
    sys.exit(0)
levels = [int(x) for x in a.streams.split(",")]
if not levels or min(levels) < 1 or a.rounds < 1:
    sys.exit("server-bench: --streams needs counts of at least 1 and --rounds at least 1")
if a.doc_tokens + 64 > a.ctx:
    sys.exit("server-bench: a %d-token document does not fit a %d-token slot (--ctx)" % (a.doc_tokens, a.ctx))
llama = a.llama_server if a.llama_server not in (None, "none") else (shutil.which("llama-server") if a.llama_server is None else None)
if llama and not os.access(llama, os.X_OK):
    sys.exit("server-bench: --llama-server %s is not an executable" % llama)


def command(name, slots):
    """The server's command line for SLOTS slots of a.ctx tokens each (the port is added by start)."""
    if name == "kvr-server":
        return [os.path.join(a.build, "kvr-server"), "-m", a.model, "-t", str(a.threads), "-np", str(slots), "-c", str(a.ctx)] + a.kvr_args.split()
    return [llama, "-m", a.model, "-t", str(a.threads), "-np", str(slots), "-c", str(slots * a.ctx), "--no-kv-unified",
            "--cont-batching", "--cache-prompt", "--cache-ram", "0", "--host", "127.0.0.1"]


def start(cmd, log):
    """Start a server on a free port and wait for its /health to answer 200 (llama-server answers
    503 while it loads); (process, port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    log.seek(0)
    log.truncate()
    p = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            c.close()
            if r.status == 200:
                return p, port
        except OSError:
            pass
        if p.poll() is not None:
            break
        time.sleep(0.2)
    p.kill()
    p.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace").splitlines()[-15:]
    raise SystemExit("server-bench: %s did not start (%s); its last words:\n%s" % (cmd[0], " ".join(cmd), "\n".join(tail)))


def stop(p):
    p.terminate()
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def stream(port, path, body):
    """One streamed request: (seconds to the first text, seconds to the end, text chunks, start
    time, usage of the final chunk or None, the arrival time of each text chunk)."""
    t0 = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(dict(body, stream=True, stream_options={"include_usage": True})),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit("server-bench: %s answered %d: %s" % (path, r.status, r.read()[:300]))
    first, n, usage, times = None, 0, None, []
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []: # the usage chunk may come with no choice
            if ch.get("text") or (ch.get("delta") or {}).get("content"):
                n += 1
                times.append(time.time())
                if first is None:
                    first = times[-1]
    c.close()
    return (first or time.time()) - t0, time.time() - t0, n, t0, usage, times


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decode_rate(port, pid, n_streams):
    """(aggregate decode tok/s while all n_streams decode, the same from the first token of any
    stream to the last of any, generated tokens per CPU second of the server). The requests start
    together, but a server admits and prefills them one after another, and they end as they began:
    the first rate is taken from the moment the last stream has its first token to the moment the
    first stream has its last, each stream's tokens in that window counted between its first and
    last there (so a stream contributes its steps, not its steps plus one)."""
    c0 = cpu_seconds(pid)
    bodies = [{"prompt": "%d, %d, %d," % (i * 100, i * 100 + 1, i * 100 + 2), "max_tokens": a.tokens, "temperature": 0,
               "ignore_eos": True} for i in range(n_streams)]
    with concurrent.futures.ThreadPoolExecutor(n_streams) as ex:
        res = list(ex.map(lambda b: stream(port, "/v1/completions", b), bodies))
    if min(len(r[5]) for r in res) < 2:
        raise SystemExit("server-bench: a stream of %d gave fewer than 2 text chunks (--tokens %d)" % (n_streams, a.tokens))
    t_first = min(r[5][0] for r in res)
    t_end = max(r[5][-1] for r in res)
    span = sum(r[2] - 1 for r in res) / (t_end - t_first)
    w0, w1 = max(r[5][0] for r in res), min(r[5][-1] for r in res)
    inside = sum(len([t for t in r[5] if w0 <= t <= w1]) - 1 for r in res)
    # streams that barely overlap have no such window: the span's rate stands for it
    steady = inside / (w1 - w0) if w1 - w0 > 0.05 * (t_end - t_first) and inside > 0 else span
    return steady, span, sum(r[2] for r in res) / (cpu_seconds(pid) - c0)


def ttft_pair(port):
    """TTFT of the document's first question, of the follow-up after another request took the slot
    (cold), and of the follow-up right after the first question (its prefix in the slot: warm);
    with the follow-up's prompt tokens and how many of them each found cached."""
    doc = " ".join("Entry %d: the keeper noted that ship %d passed the northern rocks at dawn with wool and salt." % (i, i * 7 % 31)
                   for i in range(a.doc_tokens // 22))
    # a system message of its own: a template's default one (SmolLM2's) is then left out by both
    # servers alike, and the two prefill the same tokens
    first = [{"role": "system", "content": "You answer from the log."},
             {"role": "user", "content": doc + "\n\nWhat does the log record?"}]
    chat = lambda m, n: stream(port, "/v1/chat/completions", {"messages": m, "temperature": 0, "max_tokens": n})
    f0 = chat(first, 8)[0]
    follow = first + [{"role": "assistant", "content": "Ships passing the rocks."}, {"role": "user", "content": "Which cargo came most?"}]
    warm = chat(follow, 8)
    chat([{"role": "system", "content": "You greet."}, {"role": "user", "content": "Hello there."}], 4)
    cold = chat(follow, 8)

    def cached(u):
        return ((u or {}).get("prompt_tokens_details") or {}).get("cached_tokens", "?")
    return {"first": f0, "cold": cold[0], "warm": warm[0], "prompt": (warm[4] or {}).get("prompt_tokens", "?"),
            "cached_cold": cached(cold[4]), "cached_warm": cached(warm[4])}


log = tempfile.TemporaryFile()
names = ["kvr-server"] + (["llama-server"] if llama else [])
results = {}
t_begin = time.time()
for name in names:
    p, port = start(command(name, max(levels)), log)
    try:
        stream(port, "/v1/completions", {"prompt": "Warm up.", "max_tokens": 4, "temperature": 0})
        # the levels interleaved, the best of each round: the machine's other load moves single
        # runs by more than the differences measured
        rate = {}
        for _ in range(a.rounds):
            for n in levels:
                got = decode_rate(port, p.pid, n)
                rate[n] = tuple(max(v, w) for v, w in zip(got, rate.get(n, (0, 0, 0))))
        results[name] = {"rate": rate}
    finally:
        stop(p)
    p, port = start(command(name, 1), log)
    try:
        results[name]["ttft"] = ttft_pair(port)
    finally:
        stop(p)

with open("/proc/loadavg") as f:
    load = " ".join(f.read().split()[:3])
base = levels[0]
ratio_at = 4 if 4 in levels else levels[-1]
out = ["## kvr-server%s beside llama-server: %s, %d threads, %d slots of %d tokens, greedy; %d-core machine, load %s at the end"
       % (" " + a.kvr_args if a.kvr_args else "", os.path.basename(a.model), a.threads, max(levels), a.ctx, os.cpu_count(), load), "",
       "Aggregate decode rate (%d tokens a stream; wall clock, best of %d interleaved rounds: the load of the machine moves it):" % (a.tokens, a.rounds),
       "while all N streams decode (from the last stream's first token to the first stream's last); over the requests' whole",
       "span (from the first token of any to the last of any: the admissions and prefills one after another, and the streams'",
       "ends, are in it); and tokens per CPU second of the server (what batching saves: one pass over the weights for every",
       "stream; less moved by the load):", "",
       "| server | " + " | ".join("%d stream%s" % (n, "s" if n > 1 else "") for n in levels) + " | %d vs %d |" % (ratio_at, base),
       "|---|" + "---|" * (len(levels) + 1)]
for name, r in results.items():
    rt = r["rate"]
    for k, what in enumerate(["decode tok/s", "span tok/s", "tok per CPU-s"]):
        out.append("| %s %s | " % (name, what) + " | ".join("%.1f" % rt[n][k] for n in levels) + " | %.2fx |" % (rt[ratio_at][k] / rt[base][k]))
if len(results) == 2:
    k, l = results["kvr-server"]["rate"], results["llama-server"]["rate"]
    out.append("| kvr / llama decode | " + " | ".join("%.2fx" % (k[n][0] / l[n][0]) for n in levels) + " | |")
if not llama:
    out.append("| llama-server | not on the PATH | " + "| " * len(levels))
out += ["", "TTFT over a document (one slot; \"no cache\": the follow-up after another request took the slot; "
        "cached: right after the first question):", "",
        "| server | follow-up prompt tokens | first request | follow-up, no cache (cached tokens) | follow-up, cached prefix (cached tokens) | cached vs not |",
        "|---|---|---|---|---|---|"]
for name, r in results.items():
    t = r["ttft"]
    out.append("| %s | %s | %.0f ms | %.0f ms (%s) | %.0f ms (%s) | %.2f |" % (name, t["prompt"], t["first"] * 1e3, t["cold"] * 1e3,
               t["cached_cold"], t["warm"] * 1e3, t["cached_warm"], t["warm"] / t["cold"]))
out += ["", "wall time %.0f s" % (time.time() - t_begin)]
text = "\n".join(out) + "\n"
print(text)
if a.out:
    if os.path.dirname(a.out):
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
