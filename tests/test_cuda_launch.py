"""The ctypes mirror of the CUDA kernels' parameter struct, checked field by field against the C
header it is derived from (nvcc compiles a host program printing offsetof of every field)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kdagen.targets.cuda_launch import HEADER, KdaParams, parse_params


def test_every_field_of_the_header_is_mirrored_in_order():
    names = [n for n, _ in parse_params(HEADER.read_text())]
    assert names[:3] == ["q", "k", "v"] and "lower_bound" in names and names[-2:] == ["h0_idx", "ht_idx"]
    assert [n for n, _ in KdaParams._fields_] == names
    assert KdaParams.q_s.size == 3 * 8 and KdaParams.scale.size == 4


def test_parse_skips_comments_that_hold_semicolons():
    fields = parse_params("struct KdaParams {\n  int a;  // one; two\n  // three; four\n  float b, c[2];\n};")
    assert [(n, t) for n, t in fields] == [("a", ctypes.c_int), ("b", ctypes.c_float), ("c", ctypes.c_float * 2)]


def test_parse_rejects_a_field_it_cannot_mirror():
    with pytest.raises(RuntimeError, match=r"KdaParams declaration 'double x' has no ctypes mirror"):
        parse_params("struct KdaParams {\n  int a;\n  double x;\n};")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_offsets_match_the_compiled_header(tmp_path: Path):
    names = [n for n, _ in KdaParams._fields_]
    prints = "\n".join(f'  printf("%s %zu\\n", "{n}", offsetof(KdaParams, {n}));' for n in names)
    src = tmp_path / "offsets.cu"
    src.write_text(f'#include <cstdio>\n#include <cstddef>\n#include "kda_common.cuh"\nint main() {{\n{prints}\n'
                   f'  printf("sizeof %zu\\n", sizeof(KdaParams));\n  return 0;\n}}\n')
    exe = tmp_path / "offsets"
    r = subprocess.run(["nvcc", f"-I{HEADER.parent}", str(src), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                         check=True).stdout.splitlines())
    assert int(out.pop("sizeof")) == ctypes.sizeof(KdaParams)
    assert {n: int(o) for n, o in out.items()} == {n: getattr(KdaParams, n).offset for n in names}
