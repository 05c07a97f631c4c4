#!/usr/bin/env python3
# tests/bench-table.py MEASURED.md SIMULATED.csv... - the parallel prefill table of the README:
# the measured points of kvr-bench's markdown tables (one or more concatenated) beside the
# simulator's predictions for the same points (kvr-bench --simulate PROFILE -o csv, one file per
# calibrated profile), one row per prompt length and strategy, the emulated link in its own
# columns. tests/bench.sh runs it; the README's table is its output.
import csv
import sys


def key(strategy, ranks, threads, link, prompt):
    return (strategy, int(ranks), int(threads), float(link), int(prompt))


measured, order = {}, []
for line in open(sys.argv[1]):
    if not line.startswith("| ") or line.startswith("| strategy"):
        continue
    c = [x.strip() for x in line.strip().strip("|").split("|")]
    # strategy ranks threads link prompt partition median min-max [predicted ratio] tok/s ...
    if c[6].startswith("failed"):
        continue
    link = 0.0 if c[3] == "-" else float(c[3].split()[0])
    k = key(c[0], c[1], c[2], link, c[4])
    lo, hi = c[7].split("-")
    measured[k] = {"part": c[5], "med": float(c[6]) / 1e3, "lo": float(lo) / 1e3, "hi": float(hi) / 1e3}
    order.append(k)

predicted = {}
for path in sys.argv[2:]:
    for r in csv.DictReader(open(path)):
        k = key(r["strategy"], r["ranks"], r["threads"], r["link_gbps"], r["prompt"])
        predicted[k] = float(r["predicted_ms"]) / 1e3


def cells(k):
    if k not in measured:
        return ["-", "-", "-"]
    m = measured[k]
    rng = f"{m['med']:.2f} ({m['lo']:.2f}–{m['hi']:.2f})" if m["hi"] > m["lo"] else f"{m['med']:.2f}"
    if k not in predicted:
        return [rng, "-", "-"]
    return [rng, f"{predicted[k]:.2f}", f"{predicted[k] / m['med']:.2f}"]


def best_single(prompt):
    t = [m["med"] for k, m in measured.items() if k[0] == "single" and k[4] == prompt]
    return min(t) if t else None


print("| prompt | strategy | partition | TTFT s (range) | predicted s | pred ÷ meas | with 10 Gb/s: TTFT s | predicted s "
      "| pred ÷ meas | speedup vs single ×2 | vs tsp |")
print("|---:|---|---|---|---:|---:|---|---:|---:|---|---|")
seen = set()
worst = 0.0
for k in order:
    s, ranks, threads, link, prompt = k
    row_key = (s, ranks, threads, prompt)
    if row_key in seen:
        continue
    seen.add(row_key)
    name = s if s != "single" else f"single ×{threads} thread{'s' if threads > 1 else ''}"
    a = key(s, ranks, threads, 0, prompt)
    b = key(s, ranks, threads, 10, prompt)
    one = best_single(prompt)
    tsp = [measured.get(key("tsp", ranks, threads, l, prompt)) for l in (0, 10)]
    sp = [f"{one / measured[x]['med']:.2f}×" if x in measured and one else "-" for x in (a, b)]
    vt = [f"{t['med'] / measured[x]['med']:.2f}×" if t and x in measured else "-" for t, x in zip(tsp, (a, b))]
    for x in (a, b):
        if x in measured and x in predicted:
            worst = max(worst, abs(predicted[x] / measured[x]["med"] - 1))
    part = measured[a]["part"] if a in measured else "-"
    print(f"| {prompt} | {name} | {part} | " + " | ".join(cells(a) + cells(b)) +
          f" | {' / '.join(sp) if s != 'single' else sp[0]} | {' / '.join(vt) if s != 'single' else '-'} |")
print(f"\nworst |predicted / measured - 1|: {100 * worst:.1f}%")
