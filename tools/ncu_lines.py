#!/usr/bin/env python3
"""Where a kernel's time goes, per SASS line, from Nsight Compute's source page, for
one or more profiles side by side (e.g. ours next to a variant, or next to FA3's):

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > NAME.csv
    tools/ncu_lines.py [--top 25] A.csv [B.csv ...]

(`benchmarks/device_varlen.sh termsncu` writes these as tsass_VARIANT_BUILD.csv.)
For each profile: the warp-stall samples by how often a line ran (execution counts
grouped into decades: the tile loop's lines share the largest counts, a CTA's set-up
the smallest), each group's share and top stall reasons, then the lines with the
most samples. The kernel's SASS of each profile is read as exported: no GPU needed.
"""

import argparse
import collections
import csv
import math
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def load(path):
    """The profile's SASS lines: (address, source, samples, executed, {stall: samples})."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[header_at]
    col = {name: i for i, name in enumerate(header)}
    # (all samples per reason; the "(Not Issued)" columns repeat a subset of them)
    stall_cols = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]

    def number(row, name):
        try:
            return float(row[col[name]].replace(",", ""))
        except (KeyError, ValueError, IndexError):
            return 0.0

    lines = []
    for r in rows[header_at + 1:]:
        if len(r) < len(header):
            continue
        lines.append((r[col["Address"]], r[col["Source"]].strip(), number(r, SAMPLES),
                      number(r, EXECUTED), {s: number(r, s) for s in stall_cols}))
    return lines


def decade(executed):
    return -1 if executed <= 0 else int(math.log10(executed))


def report(path, top):
    lines = load(path)
    total = sum(l[2] for l in lines) or 1.0
    print(f"== {path}: {len(lines)} lines, {total:.0f} samples, "
          f"{sum(l[3] for l in lines):.4g} instructions executed")
    groups = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
    for _, _, samples, executed, stalls in lines:
        g = groups[decade(executed)]
        g[0] += 1
        g[1] += samples
        g[2].update(stalls)
    for d in sorted(groups, reverse=True):
        n, samples, stalls = groups[d]
        runs = "never ran" if d < 0 else f"ran 1e{d}-1e{d + 1} times"
        reasons = ", ".join(f"{k[len('stall_'):]} {v / max(samples, 1):.0%}"
                            for k, v in stalls.most_common(4) if v)
        print(f"  {runs:22s} {n:6d} lines {samples:10.0f} samples ({samples / total:6.1%})  {reasons}")
    print(f"  top {top} lines by samples:")
    for addr, source, samples, executed, stalls in sorted(lines, key=lambda l: -l[2])[:top]:
        reason = max(stalls, key=stalls.get)[len("stall_"):] if stalls and max(stalls.values()) else ""
        print(f"  {samples:8.0f} {samples / total:6.1%} x{executed:<10.0f} {addr[-6:]} "
              f"{reason:14s} {source[:70]}")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for path in args.csv:
        report(path, args.top)


if __name__ == "__main__":
    main(sys.argv[1:])
