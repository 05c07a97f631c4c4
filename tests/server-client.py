#!/usr/bin/env python3
# tests/server-client.py - the client side of tests/server.sh: drives a running kvr-server with
# the Python standard library (raw HTTP: malformed requests, a client that hangs up mid-stream,
# a long prefill admitted in chunks beside a running stream, concurrency, a bounded load run) and, where the openai package is importable (the venv
# tests/server.sh makes), with OpenAI's own client. Greedy answers are compared with the texts
# kvr-run gave for the same turns (a JSON file tests/server.sh wrote).
#
#   server-client.py URL PID EXPECTED.json [--api-key KEY]
#
# With QUICK=1 in the environment (the sanitizer build's run) only the malformed requests, one
# greedy chat and the disconnect run.
#
# Prints "ok ..." / "FAIL ..." / "SKIP ..." lines and a last line "N passed, M failed, K skipped".

import concurrent.futures
import http.client
import json
import os
import socket
import sys
import threading
import time
import urllib.parse

url, pid, expected_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
quick = os.environ.get("QUICK") == "1"
api_key = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--api-key" else None
with open(expected_path) as f:
    expected = json.load(f)
host, port = urllib.parse.urlparse(url).hostname, urllib.parse.urlparse(url).port
n_pass = n_fail = n_skip = 0
lock = threading.Lock()


def check(cond, what):
    global n_pass, n_fail
    with lock:
        if cond:
            n_pass += 1
            print("ok   " + what)
        else:
            n_fail += 1
            print("FAIL " + what)
    sys.stdout.flush()


def skip(what):
    global n_skip
    n_skip += 1
    print("SKIP " + what)


def request(method, path, body=None, headers=None, timeout=120):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = "Bearer " + api_key
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def post(path, body, **kw):
    status, data = request("POST", path, body, **kw)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, None


def metrics():
    _, data = request("GET", "/metrics")
    out = {}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def proc_counts():
    fds = len(os.listdir("/proc/%d/fd" % pid))
    with open("/proc/%d/status" % pid) as f:
        status = {l.split(":")[0]: l.split()[1] for l in f if len(l.split()) > 1}
    return fds, int(status["Threads"]), int(status["VmRSS"]) // 1024


def chat_body(q, n, stream=False, **kw):
    b = {"model": "kvr", "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": n, "stream": stream}
    b.update(kw)
    return b


def sse_text(raw):
    """The text of an SSE answer: its deltas joined; and whether it ended with [DONE]."""
    text, done = "", False
    for line in raw.decode("utf-8").split("\n"):
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        ch = json.loads(line[6:])["choices"][0]
        text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return text, done


# 1. malformed requests: a JSON error with a 4xx status each, and the server goes on
bad = [
    ("not JSON", "/v1/chat/completions", "{\"messages\": [", 400),
    ("not an object", "/v1/chat/completions", "[1, 2]", 400),
    ("no messages", "/v1/chat/completions", {"model": "x"}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("a message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400),
    ("an unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("max_tokens a string", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("max_tokens negative", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("temperature out of range", "/v1/completions", {"prompt": "hi", "temperature": 7}, 400),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("stream a string", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400),
    ("five stop strings", "/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("an empty stop string", "/v1/completions", {"prompt": "hi", "stop": ""}, 400),
    ("prompt a number", "/v1/completions", {"prompt": 42}, 400),
    ("invalid UTF-8", "/v1/completions", b"{\"prompt\": \"\xff\xfe\"}", 400),
    ("a prompt longer than the context", "/v1/completions", {"prompt": "word " * 5000, "max_tokens": 4}, 400),
    ("a body over the limit", "/v1/completions", {"prompt": "x" * (1 << 21)}, 413),
    ("an unknown endpoint", "/v1/nothing", {"prompt": "hi"}, 404),
]
for what, path, body, want in bad:
    status, j = post(path, body)
    ok = status == want and isinstance(j, dict) and isinstance(j.get("error"), dict) and j["error"].get("message")
    check(ok, "malformed: %s: %d %s" % (what, status, (j or {}).get("error", {}).get("message", "(no JSON error)")[:80]))
status, _ = request("GET", "/v1/chat/completions")
check(status == 405, "GET on a POST endpoint: %d" % status)
if api_key:
    status, j = post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer wrong"})
    check(status == 401 and j and j["error"]["type"] == "authentication_error", "a wrong API key: %d" % status)
    status, j = post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"Authorization": ""})
    check(status == 401, "no API key: %d" % status)
# a client that sends half a body and stops: the read timeout drops it, others are served meanwhile
s = socket.create_connection((host, port), timeout=30)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
status, j = post("/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "temperature": 0})
check(status == 200, "served while another client stalls mid-body: %d" % status)
s.close()
status, data = request("GET", "/health")
check(status == 200 and json.loads(data)["status"] == "ok", "the server goes on after the malformed requests")

if quick:
    expected["chat"] = expected["chat"][:1]

# 2. greedy answers equal kvr-run's: chat (not streamed and streamed), a plain completion
for case in expected["chat"]:
    status, j = post("/v1/chat/completions", chat_body(case["q"], case["n"]))
    got = j["choices"][0]["message"]["content"] if status == 200 else None
    check(got == case["text"], "chat, not streamed, equals kvr-run -cnv: %r vs %r" % (got, case["text"]))
    if status == 200:
        u = j["usage"]
        check(u["completion_tokens"] > 0 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], "usage: %s" % u)
    status, raw = request("POST", "/v1/chat/completions", chat_body(case["q"], case["n"], stream=True))
    text, done = sse_text(raw) if status == 200 else (None, False)
    check(text == case["text"] and done, "chat, streamed by SSE, equals kvr-run -cnv and ends with [DONE]: %r" % text)
c = expected["completion"]
status, j = post("/v1/completions", {"prompt": c["prompt"], "max_tokens": c["n"], "temperature": 0})
got = j["choices"][0]["text"] if status == 200 else None
check(got == c["text"], "/v1/completions equals kvr-run -p: %r vs %r" % (got, c["text"]))
status, j = post("/v1/completions", {"prompt": c["prompt"], "max_tokens": c["n"], "temperature": 0, "stop": [c["stop"]]})
got = j["choices"][0]["text"] if status == 200 else None
want = c["text"][: c["text"].find(c["stop"])]
check(got == want and j["choices"][0]["finish_reason"] == "stop", "a stop string cuts the text there: %r vs %r" % (got, want))

# 3. the prompt cache: a follow-up over the same document prefills only what is new
def section_3():
    doc = expected["document"]
    q1 = [{"role": "user", "content": doc + "\n\nWhat is this text about?"}]
    status, j1 = post("/v1/chat/completions", {"messages": q1, "temperature": 0, "max_tokens": 8})
    q2 = q1 + [{"role": "assistant", "content": j1["choices"][0]["message"]["content"]}, {"role": "user", "content": "Say it shorter."}]
    status, j2 = post("/v1/chat/completions", {"messages": q2, "temperature": 0, "max_tokens": 8})
    cached = j2["usage"]["prompt_tokens_details"]["cached_tokens"] if status == 200 else -1
    check(cached >= j1["usage"]["prompt_tokens"] - 1, "the follow-up found %d of its %d prompt tokens cached (the first had %d)"
          % (cached, j2["usage"]["prompt_tokens"], j1["usage"]["prompt_tokens"]))


if not quick:
    section_3()

# 3b. a long prefill is admitted in chunks (--chunk, 256 tokens): a running stream goes on
# between them instead of waiting for the whole prompt
def section_3b():
    doc = " ".join([expected["document"]] * 3)
    times, stop = [], threading.Event()

    def reader():
        s = socket.create_connection((host, port), timeout=300)
        body = json.dumps({"prompt": "1, 2, 3, 4,", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        auth = ("Authorization: Bearer %s\r\n" % api_key) if api_key else ""
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
                   % (auth, len(body))).encode() + body)
        while not stop.is_set():
            chunk = s.recv(65536)
            if not chunk:
                break
            times.extend([time.time()] * chunk.count(b"data: "))
        s.close()
    th = threading.Thread(target=reader)
    th.start()
    for _ in range(600):
        if len(times) >= 3:
            break
        time.sleep(0.1)
    t0 = time.time()
    status, j = post("/v1/completions", {"prompt": doc, "max_tokens": 1, "temperature": 0})
    t1 = time.time()
    stop.set()
    th.join(60)
    during = [t for t in times if t0 <= t <= t1]
    gaps = [b - a for a, b in zip([t0] + during, during + [t1])]
    n = j["usage"]["prompt_tokens"] if status == 200 else 0
    check(status == 200 and n > 3 * 256 and len(during) >= 3 and max(gaps) < 0.5 * (t1 - t0),
          "a %d-token prefill (%.1f s) let the running stream on: %d tokens meanwhile, longest wait %.1f s"
          % (n, t1 - t0, len(during), max(gaps)))


if not quick:
    section_3b()

# 4. concurrent greedy requests: each equals its solo answer
def section_4():
    solo = expected["concurrent"]
    with concurrent.futures.ThreadPoolExecutor(len(solo)) as ex:
        futs = [ex.submit(request, "POST", "/v1/chat/completions", chat_body(s["q"], s["n"], stream=True)) for s in solo]
        for s, fut in zip(solo, futs):
            status, raw = fut.result()
            text, done = sse_text(raw) if status == 200 else (None, False)
            check(text == s["text"] and done, "concurrent stream equals its solo run: %r" % (text,))
    m = metrics()
    check(m.get("kvr_batch_tokens_total", 0) > m.get("kvr_batch_steps_total", 1), "decode steps ran several sequences at once (%d tokens in %d steps)"
          % (m.get("kvr_batch_tokens_total", 0), m.get("kvr_batch_steps_total", 0)))


if not quick:
    section_4()

# 5. a client gone mid-stream frees its slot; the next request is served
before = metrics().get("kvr_cancelled_total", 0)
s = socket.create_connection((host, port), timeout=30)
body = json.dumps({"prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 1500, "temperature": 0, "stream": True}).encode()
auth = ("Authorization: Bearer %s\r\n" % api_key) if api_key else ""
s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
           % (auth, len(body))).encode() + body)
got = b""
while got.count(b"data: ") < 3:
    chunk = s.recv(4096)
    if not chunk:
        break
    got += chunk
s.close()
freed = False
for _ in range(100):
    m = metrics()
    if m.get("kvr_cancelled_total", 0) > before and m.get("kvr_slots_busy", 1) == 0:
        freed = True
        break
    time.sleep(0.1)
check(freed, "a client gone mid-stream: its request cancelled and its slot freed (cancelled %d -> %d)"
      % (before, metrics().get("kvr_cancelled_total", 0)))
status, j = post("/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
check(status == 200, "the next request is served: %d" % status)

# 6. the Python openai client
def section_6():
    try:
        import openai
    except ImportError:
        openai = None
        skip("the openai package: not importable (tests/server.sh installs it from PyPI into a venv when PyPI is reachable)")
    if openai:
        cl = openai.OpenAI(base_url=url + "/v1", api_key=api_key or "none", timeout=120, max_retries=0)
        for case in expected["chat"]:
            r = cl.chat.completions.create(model="kvr", messages=[{"role": "user", "content": case["q"]}], temperature=0, max_tokens=case["n"])
            check(r.choices[0].message.content == case["text"], "openai chat.completions.create equals kvr-run -cnv: %r" % r.choices[0].message.content)
            st = cl.chat.completions.create(model="kvr", messages=[{"role": "user", "content": case["q"]}], temperature=0, max_tokens=case["n"], stream=True)
            text = "".join((ch.choices[0].delta.content or "") for ch in st if ch.choices)
            check(text == case["text"], "openai chat.completions.create(stream=True) equals kvr-run -cnv: %r" % text)
        r = cl.completions.create(model="kvr", prompt=c["prompt"], temperature=0, max_tokens=c["n"])
        check(r.choices[0].text == c["text"], "openai completions.create equals kvr-run -p: %r" % r.choices[0].text)
        models = cl.models.list()
        check(len(models.data) == 1, "openai models.list: %s" % [m.id for m in models.data])
        try:
            cl.chat.completions.create(model="kvr", messages=[], max_tokens=2)
            check(False, "openai: empty messages raise BadRequestError")
        except openai.BadRequestError as e:
            check(e.status_code == 400, "openai: empty messages raise BadRequestError (%s)" % e.status_code)


if not quick:
    section_6()

# 7. a bounded load run: 64 requests at concurrency 8, no error, fds, threads and memory back near the start
def section_7():
    def one(i):
        if i % 2:
            st, raw = request("POST", "/v1/completions", {"prompt": "Count: %d," % i, "max_tokens": 6, "temperature": 0.7, "seed": i, "stream": True})
            return st == 200 and sse_text(raw)[1]
        st, j = post("/v1/chat/completions", chat_body("Say a word about %d." % i, 6))
        return st == 200 and j["choices"][0]["message"]["content"] is not None
    base_fds, base_threads, base_rss = proc_counts()
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(64)))
    check(all(results), "load: 64 requests at concurrency 8, %d failed (%.1f s)" % (results.count(False), time.time() - t0))
    time.sleep(1.0)
    fds, threads, rss = proc_counts()
    check(fds <= base_fds + 2 and threads <= base_threads + 2, "load: fds %d (start %d), threads %d (start %d)" % (fds, base_fds, threads, base_threads))
    # the slots' caches may grow to the longest prompt seen (short here): a leak of a request's
    # buffers would add up over the 64
    check(rss <= base_rss * 1.1 + 32, "load: resident memory %d MiB (start %d MiB)" % (rss, base_rss))
    m = metrics()
    check(m.get("kvr_queue_depth", 1) == 0 and m.get("kvr_slots_busy", 1) == 0, "load: the queue and the slots are empty after it")



if not quick:
    section_7()

print("%d passed, %d failed, %d skipped" % (n_pass, n_fail, n_skip))
sys.exit(1 if n_fail else 0)
