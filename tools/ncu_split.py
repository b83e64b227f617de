#!/usr/bin/env python3
"""Kernel-time split of eddy passes from an ncu CSV log (docs/cuda.md, "Where the time goes").

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        --log-file ncu.csv <test binary> --ignored --exact profile_prefill_verify_decode
    tools/ncu_split.py ncu.csv prefill verify decode

Each pass begins with an `embed` kernel; the passes are named by the arguments in order. Prints, per pass, the
kernel time per kernel name (sum, count) and the total, in microseconds.
"""
import collections
import csv
import io
import sys


def main() -> None:
    path, names = sys.argv[1], sys.argv[2:]
    lines = [l for l in open(path, encoding="utf-8", errors="replace") if l.startswith('"')]
    passes: list[collections.OrderedDict] = []
    for row in csv.DictReader(io.StringIO("".join(lines))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        kernel = row["Kernel Name"].split("(")[0]
        if kernel == "embed" or not passes:
            passes.append(collections.OrderedDict())
        unit = row.get("Metric Unit", "nsecond")
        v = float(row["Metric Value"].replace(",", ""))
        us = v / 1000.0 if unit in ("nsecond", "ns") else v if unit in ("usecond", "us") else v * 1000.0
        s, c = passes[-1].get(kernel, (0.0, 0))
        passes[-1][kernel] = (s + us, c + 1)
    for i, p in enumerate(passes):
        name = names[i] if i < len(names) else f"pass {i}"
        total = sum(s for s, _ in p.values())
        print(f"== {name}: {total:.1f} us of kernel time, {sum(c for _, c in p.values())} kernels")
        for k, (s, c) in sorted(p.items(), key=lambda kv: -kv[1][0]):
            print(f"  {k:24s} {s:9.1f} us  {c:4d} x {s / c:7.2f} us  {100 * s / total:5.1f} %")


if __name__ == "__main__":
    main()
