#!/usr/bin/env python3
"""Compile the CUDA translation units as cmake/cuda.cmake does and compare kernels.

A refactor of kernel sources should leave the generated code alone. This tool
records, per kernel and GPU architecture, what ptxas reports (registers, spills,
shared memory) and the SASS (cuobjdump), then compares two such records by kernel
name, wherever the kernel's translation unit lives.

    tools/compare_sass.py build [-j 2] SRC_ROOT OUT_DIR [UNIT ...]  # default: every csrc/**/*.cu
    tools/compare_sass.py compare BEFORE_DIR AFTER_DIR [--rename 'REGEX=>REPL' ...]

`--rename` rewrites the demangled kernel names of BEFORE (e.g. when a template
parameter was added) so that they match AFTER's. No GPU is needed.
"""

import argparse
import collections
import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys

# Flags of cmake/cuda.cmake for the default build (sm_80 + sm_90a + compute_80 PTX,
# head dims 64/128/256).
NVCC_FLAGS = [
    "-std=c++17",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=[sm_80,compute_80]",
    "-O3", "-lineinfo", "--expt-relaxed-constexpr", "-Xcompiler=-fvisibility=hidden",
    "-DFLASHJAX_HOPPER=1", "-DFLASHJAX_WITH_CUDA=1",
    "-DFLASHJAX_TC_HEAD_DIM_64=1", "-DFLASHJAX_TC_HEAD_DIM_128=1",
    "-DFLASHJAX_TC_HEAD_DIM_256=1",
    "-Xptxas", "-v",
]

# "/*0a30*/  IMAD.MOV.U32 R1, RZ, RZ, R2 ;  /* 0x... */" -> "IMAD.MOV.U32 R1, RZ, RZ, R2 ;"
SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*(?:/\*\s*0x[0-9a-f]+\s*\*/)?\s*$")
PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USAGE = re.compile(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?")


def translation_units(root):
    return sorted((root / "csrc").rglob("*.cu"))


def compile_unit(root, source, out_dir):
    name = str(source.relative_to(root / "csrc")).replace("/", "__")
    obj = out_dir / (name + ".o")
    cmd = ["nvcc", *NVCC_FLAGS, f"-I{root / 'csrc/include'}", f"-I{root / 'csrc'}",
           "-c", str(source), "-o", str(obj)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    (out_dir / (name + ".ptxas")).write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        return name, f"nvcc failed ({run.returncode})"
    sass = subprocess.run(["cuobjdump", "-sass", str(obj)], capture_output=True,
                          text=True, check=True).stdout
    (out_dir / (name + ".sass")).write_text(sass)
    return name, "ok"


def build(args):
    root = pathlib.Path(args.src_root).resolve()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        units = [root / u for u in args.units] if args.units else translation_units(root)
        jobs = [pool.submit(compile_unit, root, s, out_dir) for s in units]
        failed = False
        for job in concurrent.futures.as_completed(jobs):
            name, result = job.result()
            print(f"{name}: {result}", flush=True)
            failed |= result != "ok"
    return 1 if failed else 0


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                         text=True, check=True).stdout.splitlines()
    return dict(zip(names, out))


def read_ptxas(path):
    """{(mangled, arch): {registers, spill_stores, spill_loads, stack, smem}}."""
    stats = {}
    arch = {}
    current = None
    for line in path.read_text().splitlines():
        if m := PTXAS_ENTRY.search(line):
            arch[m.group(1)] = m.group(2)
            current = (m.group(1), m.group(2))
            stats[current] = {}
        elif m := PTXAS_FUNCTION.search(line):
            current = (m.group(1), arch.get(m.group(1), "?"))
            stats.setdefault(current, {})
        elif current and (m := PTXAS_SPILLS.search(line)):
            stats[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            smem = re.search(r"(\d+) bytes smem", line)
            stats[current].update(registers=int(m.group(1)),
                                  smem=int(smem.group(1)) if smem else 0)
    return stats


def read_sass(path):
    """{(mangled, arch): [instruction text]} (addresses and encodings dropped)."""
    kernels = {}
    arch = None
    current = None
    for line in path.read_text().splitlines():
        if m := re.search(r"arch = (sm_\w+)", line):
            arch = m.group(1)
        elif m := re.match(r"\s*Function : (\S+)", line):
            current = kernels.setdefault((m.group(1), arch), [])
        elif current is not None and (m := SASS_LINE.match(line)):
            if m.group(1):
                current.append(m.group(1))
    return kernels


def load(out_dir):
    out_dir = pathlib.Path(out_dir)
    stats, sass = {}, {}
    for p in out_dir.glob("*.ptxas"):
        stats.update(read_ptxas(p))
    for p in out_dir.glob("*.sass"):
        sass.update(read_sass(p))
    return stats, sass


def opcode(instruction):
    text = re.sub(r"^@!?U?P\w+\s+", "", instruction)  # predicate guard
    return text.split()[0] if text.split() else ""


def normalise(instructions):
    """Instruction text with register numbers and branch targets renamed away."""
    text = [re.sub(r"\b(U?R|U?P|B)\d+\b", r"\1", i) for i in instructions]
    return [re.sub(r"0x[0-9a-f]+", "0x", i) for i in text]


def compare(args):
    before_stats, before_sass = load(args.before)
    after_stats, after_sass = load(args.after)
    names = sorted({k[0] for k in [*before_sass, *after_sass, *before_stats, *after_stats]})
    readable = demangle(names)
    renames = [tuple(r.split("=>", 1)) for r in args.rename]

    def key(entry, renamed):
        name = readable.get(entry[0], entry[0])
        if renamed:
            for pattern, repl in renames:
                name = re.sub(pattern, repl, name)
        return name, entry[1]

    before = {key(k, True): (before_stats.get(k, {}), v) for k, v in before_sass.items()}
    after = {key(k, False): (after_stats.get(k, {}), v) for k, v in after_sass.items()}
    if args.only:
        before = {k: v for k, v in before.items() if re.search(args.only, k[0])}
        after = {k: v for k, v in after.items() if re.search(args.only, k[0])}
    counts = collections.Counter()
    report = []
    for k in sorted(set(before) | set(after)):
        if k not in after or k not in before:
            counts["only before" if k in before else "only after"] += 1
            report.append(f"ONLY {'BEFORE' if k in before else 'AFTER'}: {k[1]} {k[0]}")
            continue
        (bs, bi), (as_, ai) = before[k], after[k]
        stat_keys = ("registers", "spill_stores", "spill_loads", "stack", "smem")
        stat_delta = {s: (bs.get(s), as_.get(s)) for s in stat_keys if bs.get(s) != as_.get(s)}
        if bi == ai and not stat_delta:
            counts["identical"] += 1
            continue
        if normalise(bi) == normalise(ai) and not stat_delta:
            counts["same up to register numbers / addresses"] += 1
            continue
        mix_b = collections.Counter(map(opcode, bi))
        mix_a = collections.Counter(map(opcode, ai))
        mix_delta = {o: mix_a[o] - mix_b[o] for o in mix_a | mix_b if mix_a[o] != mix_b[o]}
        counts["different" if (mix_delta or stat_delta) else "same count and mix"] += 1
        report.append(f"{'DIFF' if (mix_delta or stat_delta) else 'REORDERED'}: {k[1]} {k[0]}\n"
                      f"    instructions {len(bi)} -> {len(ai)}; stats {stat_delta or 'same'};"
                      f" mix delta {dict(sorted(mix_delta.items())) or 'none'}")
    print("\n".join(report))
    print(json.dumps(dict(counts), indent=1))
    spilled = [(k, s) for k, s in after_stats.items() if s.get("spill_stores")]
    for k, s in sorted(spilled):
        print(f"spills after: {k[1]} {readable.get(k[0], k[0])[:160]}: {s}")
    return 0 if set(counts) <= {"identical", "same up to register numbers / addresses"} else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("src_root")
    b.add_argument("out_dir")
    b.add_argument("-j", "--jobs", type=int, default=2)
    b.add_argument("units", nargs="*", help="paths under SRC_ROOT (default: csrc/**/*.cu)")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--rename", action="append", default=[], metavar="REGEX=>REPL")
    c.add_argument("--only", default="", metavar="REGEX",
                   help="compare only kernels (demangled, renamed) matching this")
    args = parser.parse_args()
    return build(args) if args.command == "build" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
