#!/usr/bin/env python3
# tests/paper-tables.py BUILD [OUT.md] - the KV-Runahead paper's setting, simulated: Llama 7B and
# Falcon 7B on its 8xA100 node at 300 GB/s (a100-nvlink) and 10 GB/s (a100-10g), 2/4/8 ranks,
# 1k-16k tokens, dense attention (what the paper ran) and causal attention (what kvr runs): TSP,
# KVR-E, KVR-S, ring-kv and the lower bounds TTFT*(p) (Eq. 3) and TTFT(p) (KVR-S, free
# communication), from `kvr-tune --simulate`, with the TTFTs the paper reports beside them where
# it reports any. Part of `make bench` (a few minutes: every KVR-S cell is a search).
import subprocess
import sys

build = sys.argv[1] if len(sys.argv) > 1 else "build"
out = open(sys.argv[2], "w") if len(sys.argv) > 2 else sys.stdout

# TTFT in seconds as the paper prints them: (model, GPUs, ctx) -> (TSP, KVR-S).
# Appendix A, Table 1 (300 GB/s, dense attention, 4 and 8 GPUs).
PAPER_NVLINK = {
    ("llama-7b", 4, 1024): (0.107, 0.097), ("llama-7b", 8, 1024): (0.117, 0.098),
    ("llama-7b", 4, 2048): (0.111, 0.100), ("llama-7b", 8, 2048): (0.117, 0.103),
    ("llama-7b", 4, 4096): (0.20, 0.17), ("llama-7b", 8, 4096): (0.12, 0.11),
    ("llama-7b", 4, 8192): (0.54, 0.41), ("llama-7b", 8, 8192): (0.30, 0.22),
    ("llama-7b", 4, 12288): (1.06, 0.76), ("llama-7b", 8, 12288): (0.57, 0.41),
    ("llama-7b", 4, 16384): (1.76, 1.24), ("llama-7b", 8, 16384): (0.92, 0.65),
    ("falcon-7b", 4, 1024): (0.107, 0.095), ("falcon-7b", 8, 1024): (0.119, 0.096),
    ("falcon-7b", 4, 2048): (0.117, 0.103), ("falcon-7b", 8, 2048): (0.118, 0.099),
    ("falcon-7b", 4, 4096): (0.28, 0.21), ("falcon-7b", 8, 4096): (0.18, 0.12),
    ("falcon-7b", 4, 8192): (0.78, 0.54), ("falcon-7b", 8, 8192): (0.47, 0.29),
}
# Appendix B, Table 3 (Llama 7B, 10 GB/s): KVR's TTFT on 1, 2 and 4 GPUs (no TSP column).
PAPER_10G_KVR = {
    (1, 1024): 0.10, (2, 1024): 0.10, (4, 1024): 0.10,
    (1, 2048): 0.24, (2, 2048): 0.16, (4, 2048): 0.19,
    (1, 4096): 0.65, (2, 4096): 0.38, (4, 4096): 0.36,
    (1, 8192): 1.95, (2, 8192): 0.99, (4, 8192): 0.72,
    (1, 12288): 3.95, (2, 12288): 1.82, (4, 12288): 1.15,
}

STRATS = ["tsp", "kvr-e", "kvr-s", "ring-kv"]
CTX = [1024, 2048, 4096, 8192, 12288, 16384]


def simulate(preset, profile, mode, ranks):
    cmd = [f"{build}/kvr-tune", "--simulate", "--preset", preset, "--profile", profile, "--ranks", ",".join(map(str, ranks)),
           "--ctx", ",".join(map(str, CTX)), "--strategy", ",".join(STRATS), "--attn", mode]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"paper-tables: {' '.join(cmd)} failed:\n{r.stderr}")
    res = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        n, ctx, name, ttft = int(cells[0]), int(cells[1]), cells[2], float(cells[3])
        if name.startswith("TTFT*"):
            name = "ttft*"
        elif name.startswith("TTFT(p)"):
            name = "ttft(p)"
        res[(n, ctx, name)] = ttft
    return res


def fmt(x):
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def kb(ctx):
    return f"{ctx // 1024}k"


for preset, title in (("llama-7b", "Llama 7B (MHA, 32 layers)"), ("falcon-7b", "Falcon 7B (MQA, 32 layers)")):
    for profile, bw in (("a100-nvlink", "300 GB/s"), ("a100-10g", "10 GB/s")):
        sims = {mode: simulate(preset, profile, mode, [2, 4, 8]) for mode in ("dense", "causal")}
        one = simulate(preset, profile, "dense", [1])
        print(f"#### {title}, {profile} ({bw}), TTFT in seconds\n", file=out)
        print("| ranks | ctx | dense: TSP | KVR-E | KVR-S | ring-kv | TTFT*(p) | TTFT(p) | KVR-S ÷ TSP "
              "| causal: TSP | KVR-E | KVR-S | ring-kv | paper TSP / KVR-S |", file=out)
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|", file=out)
        for n in (2, 4, 8):
            for ctx in CTX:
                d, c = sims["dense"], sims["causal"]
                row = [str(n), kb(ctx)]
                row += [fmt(d[(n, ctx, s)]) for s in STRATS]
                row += [fmt(d[(n, ctx, "ttft*")]), fmt(d[(n, ctx, "ttft(p)")])]
                row += [f"{d[(n, ctx, 'tsp')] / d[(n, ctx, 'kvr-s')]:.2f}×"]
                row += [fmt(c[(n, ctx, s)]) for s in STRATS]
                paper = "-"
                if profile == "a100-nvlink" and (preset, n, ctx) in PAPER_NVLINK:
                    t, k = PAPER_NVLINK[(preset, n, ctx)]
                    paper = f"{t} / {k} ({t / k:.2f}×)"
                elif profile == "a100-10g" and preset == "llama-7b" and (n, ctx) in PAPER_10G_KVR:
                    paper = f"KVR {PAPER_10G_KVR[(n, ctx)]}"
                row.append(paper)
                print("| " + " | ".join(row) + " |", file=out)
        singles = ", ".join(f"{kb(ctx)} {fmt(one[(1, ctx, 'tsp')])}" for ctx in CTX)
        print(f"\nOne GPU (dense): {singles}.\n", file=out)
