"""The mask tile summaries' spans (csrc/cuda/common/mask_tiles.h, host and device):
MaskTiles::Entry::span / col_span and MaskTiles::on_grid against brute force, compiled
for the host (tests/cuda/mask_spans_host.cc; skipped without a C++ compiler or the CUDA
headers)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA_INCLUDE = pathlib.Path("/usr/local/cuda/include")


@pytest.mark.skipif(shutil.which("g++") is None or not (CUDA_INCLUDE / "cuda_runtime.h").exists(),
                    reason="needs g++ and the CUDA headers")
def test_spans_match_brute_force(tmp_path):
    binary = tmp_path / "mask_spans_host"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc/include'}",
                    f"-I{CUDA_INCLUDE}", str(ROOT / "tests/cuda/mask_spans_host.cc"), "-o",
                    str(binary)], check=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout
