#!/usr/bin/env python3
"""Where a kernel's time goes, per SASS line, from Nsight Compute's source page, for
one or more profiles side by side (e.g. ours next to a variant, or next to FA3's):

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > NAME.csv
    tools/ncu_lines.py [--top 25] A.csv [B.csv ...]

(`benchmarks/device_varlen.sh termsncu` writes these as tsass_VARIANT_BUILD.csv.)
With --source DIS (one profile), the samples by source line: DIS is `nvdisasm -gi -c` of
the same kernel compiled here with -lineinfo (a translation unit instantiating just it;
the SASS must match the profiled build's, which the line counts show), and each
instruction counts for the innermost inlined frame whose file matches --frames (e.g.
'sm90/bwd_(mainloop|dq_writer|producer|epilogue)': the roles' code, not the helpers').
For each profile: the warp-stall samples by how often a line ran (execution counts
grouped into decades: the tile loop's lines share the largest counts, a CTA's set-up
the smallest), each group's share and top stall reasons, then the lines with the
most samples. The kernel's SASS of each profile is read as exported: no GPU needed.
"""

import argparse
import collections
import csv
import math
import re
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


def source_frames(dis_path):
    """{address offset: [(file, line), ...] innermost first} from `nvdisasm -gi` output."""
    frames, chains, in_header = [], {}, False
    for text in open(dis_path):
        m = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if m:
            if not in_header:
                frames = []
            frames.append((m.group(1), int(m.group(2))))
            in_header = True
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/", text)
        if m:
            in_header = False
            chains[int(m.group(1), 16)] = frames
    return chains


def report_sources(path, dis_path, frames_regex, top):
    lines = load(path)
    chains = source_frames(dis_path)
    wanted = re.compile(frames_regex)
    base = int(lines[0][0], 16)
    total = sum(l[2] for l in lines) or 1.0
    by_line = collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()])
    for addr, _, samples, executed, _ in lines:
        chain = chains.get(int(addr, 16) - base, [])
        frame = next((f for f in chain if wanted.search(f[0])), chain[-1] if chain else ("?", 0))
        entry = by_line[f"{frame[0].rsplit('/', 1)[-1]}:{frame[1]}"]
        entry[0] += samples
        entry[1] += executed
        entry[2][int(executed)] += 1
    print(f"== {path} by source line ({len(chains)} instructions in {dis_path}, "
          f"{len(lines)} in the profile)")
    for where, (samples, executed, counts) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:top]:
        runs = ", ".join(f"x{c:.0f}: {n}" for c, n in counts.most_common(2))
        print(f"  {samples:8.0f} {samples / total:6.1%} {executed / 1e6:8.2f}M instr  {where:32s} ({runs})")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--source", help="nvdisasm -gi output of the profiled kernel")
    parser.add_argument("--frames", default=r"sm90/(bwd|fwd)_",
                        help="regex of the files whose frames lines count for")
    args = parser.parse_args(argv)
    if args.source:
        if len(args.csv) != 1:
            parser.error("--source takes one profile")
        report_sources(args.csv[0], args.source, args.frames, args.top)
        return
    for path in args.csv:
        report(path, args.top)


if __name__ == "__main__":
    main(sys.argv[1:])
