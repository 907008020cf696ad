#!/usr/bin/env python3
"""Per-kernel-class table of one decode step from an Nsight Compute profile.

Input: the raw CSV page of a profile of a run whose last steps are decode
steps of the same shape (CUDA-graph replays profiled node by node), made with

    ncu --clock-control none --graph-profiling node --print-units base \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        --export step.ncu-rep PROGRAM ...
    ncu --import step.ncu-rep --csv --page raw --print-units base \\
        --print-kernel-base function > step.csv

The last step is found as the shortest repeating window of kernel names at
the end of the profile (at least --min-kernels long). Each of its kernels is
put in a class (first matching pattern of CLASSES); per class the table gives
the kernels, their summed duration, the DRAM bytes they moved, the bandwidth
that makes, and the floor: the bytes at the device's copy bandwidth
(--bandwidth-gbs). Prints a markdown table; --json writes the rows.

    python3 scripts/profile_step.py step.csv --bandwidth-gbs 4300 [--layers 32 --of-layers 4]

With --layers N --of-layers M (a profile of an M-layer model of the same
shapes), the classes that run once per layer are scaled by N / M: the
"per-layer" classes below; the rest (embedding, lm_head, sampling) run once.
"""
import argparse
import csv
import json
import re
import sys

MATMUL = r"skinny_matmul|skinny_mma|gemm|gemv|xmma|cutlass|sm90_|splitKreduce|nvjet"
# (class, pattern on the kernel's base name, runs once per decoder layer)
CLASSES = [
    ("attention (paged, split-KV merge/reduce)", r"unified_attention|reduce_segments", True),
    ("KV store + rotary", r"reshape_and_cache|rotary|rope", True),
    ("RMS norm (+ residual add)", r"add_rms_norm", True),
    # A plain norm: the first layer's input norm, once per step.
    ("RMS norm (+ residual add)", r"rms_norm", False),
    ("gated activation (SiLU x up)", r"silu_mul|gelu_tanh_mul", True),
    ("matmul (cuBLAS, skinny kernels)", MATMUL, True),
    ("copies / casts / elementwise",
     r"copy|cast|affine|fill|binary|unary|badd|bmul|bsub|bdiv|where|index|gather|embed|^is_u32|^is_i64|^ucos|^usin",
     False),
    ("argmax / sampling", r"argmax|max|reduce|softmax|sample|greedy", False),
]
# The last matmul of a step is the LM head, which runs once per step (not
# per layer).
LM_HEAD = "LM head (the step's last matmul)"


def num(s):
    s = (s or "").replace(",", "").strip()
    try:
        return float(s)
    except ValueError:
        return 0.0


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        sys.exit(f"{path}: no 'Kernel Name' column: not an ncu --csv --page raw export")
    head = rows[start]
    col = {name: head.index(name) for name in head}
    need = ["Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"]
    missing = [n for n in need if n not in col]
    if missing:
        sys.exit(f"{path}: missing columns {missing}")
    units = rows[start + 1]
    if units[col["gpu__time_duration.sum"]] not in ("nsecond", "ns"):
        sys.exit(f"{path}: durations in {units[col['gpu__time_duration.sum']]!r}: export with --print-units base")
    out = []
    for r in rows[start + 2:]:
        if len(r) < len(head):
            continue
        out.append({
            "name": r[col["Kernel Name"]],
            "ns": num(r[col["gpu__time_duration.sum"]]),
            "bytes": num(r[col["dram__bytes_read.sum"]]) + num(r[col["dram__bytes_write.sum"]]),
        })
    return out


def last_step(kernels, min_kernels):
    names = [k["name"] for k in kernels]
    for p in range(min_kernels, len(names) // 2 + 1):
        if names[-p:] == names[-2 * p:-p]:
            return kernels[-p:]
    sys.exit(f"no repeating window of >= {min_kernels} kernels at the end of the profile "
             f"({len(names)} kernels): profile more than one decode step of one shape")


def classify(name):
    for cls, pat, per_layer in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls, per_layer
    return "other", False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--bandwidth-gbs", type=float, required=True, help="copy bandwidth of the floor")
    ap.add_argument("--min-kernels", type=int, default=8)
    ap.add_argument("--layers", type=int, help="decoder layers to scale the per-layer classes to")
    ap.add_argument("--of-layers", type=int, help="decoder layers of the profiled model")
    ap.add_argument("--json")
    ap.add_argument("--list", action="store_true", help="also list the step's kernels in order")
    a = ap.parse_args()
    if (a.layers is None) != (a.of_layers is None) or (a.of_layers is not None and a.of_layers < 1):
        sys.exit("--layers and --of-layers go together, with --of-layers >= 1")
    scale = a.layers / a.of_layers if a.layers else 1.0
    step = last_step(read(a.csv), a.min_kernels)
    bw = a.bandwidth_gbs * 1e9
    by = {}
    matmuls = [i for i, k in enumerate(step) if re.search(MATMUL, k["name"], re.IGNORECASE)]
    lm_head = matmuls[-1] if matmuls else None
    for i, k in enumerate(step):
        cls, per_layer = (LM_HEAD, False) if i == lm_head else classify(k["name"])
        f = scale if per_layer else 1.0
        e = by.setdefault(cls, {"class": cls, "kernels": 0.0, "us": 0.0, "bytes": 0.0, "names": set()})
        e["kernels"] += f
        e["us"] += f * k["ns"] / 1e3
        e["bytes"] += f * k["bytes"]
        e["names"].add(k["name"])
    total_us = sum(e["us"] for e in by.values())
    total_b = sum(e["bytes"] for e in by.values())
    rows = sorted(by.values(), key=lambda e: -e["us"])
    scaled = f" (per-layer classes x {a.layers}/{a.of_layers})" if a.layers else ""
    print(f"One decode step: {len(step)} kernels profiled{scaled}; floor = DRAM bytes / {a.bandwidth_gbs:.0f} GB/s\n")
    print("| kernel class | kernels | time µs | share | DRAM MB | GB/s | floor µs | time / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for e in rows + [{"class": "**all kernels**", "kernels": sum(x["kernels"] for x in rows),
                      "us": total_us, "bytes": total_b}]:
        floor = e["bytes"] / bw * 1e6
        gbs = e["bytes"] / (e["us"] * 1e-6) / 1e9 if e["us"] > 0 else 0.0
        ratio = f"{e['us'] / floor:.2f}" if floor > 0 else "-"
        print(f"| {e['class']} | {e['kernels']:.0f} | {e['us']:.1f} | {100 * e['us'] / total_us:.1f}% "
              f"| {e['bytes'] / 1e6:.1f} | {gbs:.0f} | {floor:.1f} | {ratio} |")
    print("\nKernels per class: " + "; ".join(f"{e['class']}: {', '.join(sorted(e['names']))}" for e in rows))
    if a.list:
        for k in step:
            print(f"  {k['ns'] / 1e3:9.2f} us {k['bytes'] / 1e6:9.2f} MB  {k['name']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kernels_profiled": len(step), "scale": scale, "bandwidth_gbs": a.bandwidth_gbs,
                       "rows": [{k: (sorted(v) if isinstance(v, set) else v) for k, v in e.items()} for e in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
