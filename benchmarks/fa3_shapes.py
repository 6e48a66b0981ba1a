"""FlashAttention-3 paper shapes on a GPU: flashjax against jax XLA and cuDNN in one run.

Usage (flashjax installed, e.g. with ``pip install --no-build-isolation .``)::

    python benchmarks/fa3_shapes.py OUTDIR [extra flashjax.bench options]
    python benchmarks/fa3_shapes.py "$OUT" --head-dim 128 --mode fwd,fwdbwd,bwd

Writes ``OUTDIR/fa3_shapes.jsonl`` (one JSON line per measurement) and
``OUTDIR/fa3_shapes.png`` (TFLOP/s vs seqlen); the table goes to stdout.
"""

import os
import sys

from flashjax import bench


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, extra = argv[0], argv[1:]
    os.makedirs(out_dir, exist_ok=True)
    return bench.main(["--fa3-shapes",
                       "--json", os.path.join(out_dir, "fa3_shapes.jsonl"),
                       "--plot", os.path.join(out_dir, "fa3_shapes.png"),
                       *extra])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
