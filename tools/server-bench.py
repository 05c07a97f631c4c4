#!/usr/bin/env python3
# tools/server-bench.py - kvr-server's figures (make bench runs it): the aggregate decode rate at
# 1, 2, 4 and 8 concurrent streams (one server, --parallel 8), and the time to first token of a
# follow-up question over a long document with and without the prompt cache (a server of one slot:
# "without" is the same follow-up after another request took the slot). Beside each, llama-server
# with the same model, threads and slots where it is on the PATH. Standard library only.
#
#   server-bench.py BUILD [MODEL.gguf] [--threads N] [--doc-tokens N] [--out FILE.md]

import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("model", nargs="?", default="models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--doc-tokens", type=int, default=2048)
ap.add_argument("--tokens", type=int, default=32, help="tokens each stream generates")
ap.add_argument("--out", default=None)
a = ap.parse_args()
if not os.path.exists(a.model):
    print("server-bench: %s is not there (tools/install-deps.sh fetches it): skipped" % a.model)
    sys.exit(0)


def start(cmd, log):
    """Start a server on a free port; (process, port)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p, port
        except OSError:
            pass
        if p.poll() is not None:
            break
        time.sleep(0.1)
    p.kill()
    raise SystemExit("server-bench: %s did not start" % cmd[0])


def stop(p):
    p.terminate()
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()


def stream(port, path, body):
    """One streamed request: (time of the first text, time of the end, tokens), seconds from its start."""
    t0 = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    first, n = None, 0
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"][0]
        if ch.get("text") or (ch.get("delta") or {}).get("content"):
            n += 1
            if first is None:
                first = time.time()
    c.close()
    return (first or time.time()) - t0, time.time() - t0, n, t0


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decode_rate(port, pid, n_streams):
    """(aggregate decode tok/s, generated tokens per CPU second of the server)"""
    c0 = cpu_seconds(pid)
    bodies = [{"prompt": "%d, %d, %d," % (i * 100, i * 100 + 1, i * 100 + 2), "max_tokens": a.tokens, "temperature": 0,
               "ignore_eos": True} for i in range(n_streams)]
    with concurrent.futures.ThreadPoolExecutor(n_streams) as ex:
        res = list(ex.map(lambda b: stream(port, "/v1/completions", b), bodies))
    t_first = min(t0 + f for f, _, _, t0 in res)
    t_end = max(t0 + e for _, e, _, t0 in res)
    toks = sum(n - 1 for _, _, n, _ in res)
    return toks / (t_end - t_first), sum(n for _, _, n, _ in res) / (cpu_seconds(pid) - c0)


def ttft_pair(port):
    doc = " ".join("Entry %d: the keeper noted that ship %d passed the northern rocks at dawn with wool and salt." % (i, i * 7 % 31)
                   for i in range(a.doc_tokens // 22))
    first = [{"role": "user", "content": doc + "\n\nWhat does the log record?"}]
    f0, _, _, _ = stream(port, "/v1/chat/completions", {"messages": first, "temperature": 0, "max_tokens": 8})
    follow = first + [{"role": "assistant", "content": "Ships passing the rocks."}, {"role": "user", "content": "Which cargo came most?"}]
    warm, _, _, _ = stream(port, "/v1/chat/completions", {"messages": follow, "temperature": 0, "max_tokens": 8})
    stream(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there."}], "temperature": 0, "max_tokens": 4})
    cold, _, _, _ = stream(port, "/v1/chat/completions", {"messages": follow, "temperature": 0, "max_tokens": 8})
    return f0, cold, warm


log = tempfile.TemporaryFile()
rows = []
servers = [("kvr-server", [os.path.join(a.build, "kvr-server"), "-m", a.model, "-t", str(a.threads), "-c", "4096"])]
llama = shutil.which("llama-server")
if llama:
    servers.append(("llama-server", [llama, "-m", a.model, "-t", str(a.threads), "-c", "0", "--host", "127.0.0.1"]))
results = {}
for name, cmd in servers:
    slots = ["-np", "8"] if name == "kvr-server" else ["-np", "8", "-c", str(8 * 4096)]
    p, port = start(cmd[:] + slots if name == "kvr-server" else [llama, "-m", a.model, "-t", str(a.threads), "--host", "127.0.0.1"] + slots, log)
    try:
        stream(port, "/v1/completions", {"prompt": "Warm up.", "max_tokens": 4, "temperature": 0})
        # the levels interleaved, three rounds, the best of each: the machine's other load moves
        # single runs by more than the differences measured
        rate = {}
        for _ in range(3):
            for n in (1, 2, 4, 8):
                w, c = decode_rate(port, p.pid, n)
                rate[n] = (max(w, rate.get(n, (0, 0))[0]), max(c, rate.get(n, (0, 0))[1]))
        results[name] = {"rate": rate}
    finally:
        stop(p)
    one = ["-np", "1"] if name == "kvr-server" else ["-np", "1", "-c", "4096", "--cache-reuse", "0"]
    p, port = start((cmd[:] + one) if name == "kvr-server" else [llama, "-m", a.model, "-t", str(a.threads), "--host", "127.0.0.1"] + one, log)
    try:
        results[name]["ttft"] = ttft_pair(port)
    finally:
        stop(p)

cpus = os.cpu_count()
out = ["## kvr-server (SmolLM2-135M-Instruct Q4_1, %d threads, %d-core machine shared with other jobs: busy, figures are rough)" % (a.threads, cpus), "",
       "Aggregate decode rate (wall clock, best of 3 interleaved rounds; the load of the machine moves it) and tokens per CPU second",
       "(what batching saves: one pass over the weights for every stream; less moved by the load):", "",
       "| server | 1 stream | 2 streams | 4 streams | 8 streams | 4 vs 1 |", "|---|---|---|---|---|---|"]
for name, r in results.items():
    rt = r["rate"]
    out.append("| %s decode tok/s | %.1f | %.1f | %.1f | %.1f | %.2fx |" % (name, rt[1][0], rt[2][0], rt[4][0], rt[8][0], rt[4][0] / rt[1][0]))
    out.append("| %s tok per CPU-s | %.1f | %.1f | %.1f | %.1f | %.2fx |" % (name, rt[1][1], rt[2][1], rt[4][1], rt[8][1], rt[4][1] / rt[1][1]))
if not llama:
    out.append("| llama-server | not on the PATH | | | | |")
out += ["", "| server | first request over the document | follow-up, no cache | follow-up, cached prefix | cached vs not |", "|---|---|---|---|---|"]
for name, r in results.items():
    f0, cold, warm = r["ttft"]
    out.append("| %s TTFT (%d-token document) | %.0f ms | %.0f ms | %.0f ms | %.2f |" % (name, a.doc_tokens, f0 * 1e3, cold * 1e3, warm * 1e3, warm / cold))
text = "\n".join(out) + "\n"
print(text)
if a.out:
    with open(a.out, "w") as f:
        f.write(text)
