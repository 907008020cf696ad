#!/usr/bin/env python3
"""One table of our attention bench beside every anchor timed in the same run.

    python3 scripts/anchor_table.py --shapes shapes.json ours.jsonl ANCHOR.jsonl [ANCHOR.jsonl ...]

Each file holds JSON lines: `{"case", "impl", "us", ...}` per timed case,
`{"case", "impl", "error"}` for a case that failed, `{"ceiling":
"copy_tbs" | "matmul_tflops", "value"}` for the run's ceilings; other lines
are skipped. `examples/bench.rs` writes ours; an anchor file may hold several
implementations (a FlashInfer run holds its decode and its FA3-backend
prefill), and each `impl` becomes a column. Per case: our median µs, our
rate (TB/s of `kv_bytes` for bandwidth-bound cases, TFLOP/s of `flops` for
compute-bound ones) as a share of the run's ceiling, then for each anchor its
median µs and our speed-up (anchor µs / our µs; above 1: ours is faster).
The last rows: per anchor, the geometric mean of the speed-ups over the
decode cases and over the prefill/chunked/mixed cases both sides ran, and
the cases each anchor did not run or failed. Ceilings come from ours.jsonl,
else the first anchor file that has them.
"""
import argparse
import json
import math
import sys


def read_runs(path):
    """{impl: {case: us or error string}}, {ceiling: value} of one file."""
    runs, ceilings = {}, {}
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if "ceiling" in obj and isinstance(obj.get("value"), (int, float)):
                ceilings[obj["ceiling"]] = float(obj["value"])
                continue
            case, impl = obj.get("case"), obj.get("impl")
            if case is None or impl is None:
                continue
            us = obj.get("us")
            ok = isinstance(us, (int, float)) and us > 0 and "error" not in obj
            runs.setdefault(impl, {})[case] = float(us) if ok else str(obj.get("error", "no time"))
    return runs, ceilings


def gmean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", required=True)
    ap.add_argument("ours")
    ap.add_argument("anchors", nargs="+")
    args = ap.parse_args()

    with open(args.shapes) as f:
        doc = json.load(f)
    cases = doc["cases"] if isinstance(doc, dict) else doc
    ours_runs, ceilings = read_runs(args.ours)
    if len(ours_runs) != 1:
        sys.exit(f"anchor_table: {args.ours} holds {len(ours_runs)} impls, expected 1")
    ours = next(iter(ours_runs.values()))
    anchors = {}
    for path in args.anchors:
        runs, ceil = read_runs(path)
        for k, v in ceil.items():
            ceilings.setdefault(k, v)
        for impl, times in runs.items():
            if impl in anchors:
                sys.exit(f"anchor_table: impl {impl} appears in two files")
            anchors[impl] = times
    missing = [k for k in ("copy_tbs", "matmul_tflops") if k not in ceilings]
    if missing:
        sys.exit(f"anchor_table: no file holds the ceilings {missing}")

    names = list(anchors)
    print(f"ceilings: copy {ceilings['copy_tbs']:.2f} TB/s, matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    print()
    head = "| case | ours µs | ours rate | " + " | ".join(f"{n} µs | vs {n}" for n in names) + " |"
    print(head)
    print("|---|---:|---:|" + "---:|---:|" * len(names))
    speedups = {n: {"decode": [], "other": []} for n in names}
    for c in cases:
        name = c["name"]
        us = ours.get(name)
        if not isinstance(us, float):
            print(f"| {name} | error: {us or 'not run'} | |" + " |" * (2 * len(names)))
            continue
        if c["bound"] == "bw":
            rate = c["kv_bytes"] / us / 1e6
            rate_s = f"{rate:.2f} TB/s ({100 * rate / ceilings['copy_tbs']:.0f}%)"
        else:
            rate = c["flops"] / us / 1e6
            rate_s = f"{rate:.0f} TFLOP/s ({100 * rate / ceilings['matmul_tflops']:.0f}%)"
        cells = []
        for n in names:
            a = anchors[n].get(name)
            if isinstance(a, float):
                sp = a / us
                speedups[n]["decode" if c["kind"] == "decode" else "other"].append(sp)
                cells += [f"{a:.1f}", f"{sp:.2f}x"]
            else:
                cells += ["-", "-"]
        print(f"| {name} | {us:.1f} | {rate_s} | " + " | ".join(cells) + " |")
    print()
    for n in names:
        parts = []
        for kind, label in (("decode", "decode"), ("other", "prefill/chunked/mixed")):
            g = gmean(speedups[n][kind])
            parts.append(f"{label} {g:.2f}x over {len(speedups[n][kind])} cases" if g else f"{label}: none")
        print(f"- vs {n}: geomean " + "; ".join(parts))
        absent = [c["name"] for c in cases if not isinstance(anchors[n].get(c["name"]), float)]
        failed = {k: v for k, v in anchors[n].items() if isinstance(v, str)}
        if absent:
            print(f"  - not timed by {n} ({len(absent)}): " + ", ".join(
                f"{a} ({failed[a]})" if a in failed else a for a in absent))


if __name__ == "__main__":
    main()
