"""`kdagen verify`: one line per variant, exit status from the comparisons."""

from __future__ import annotations

import re

from click.testing import CliRunner

from kdagen.cli import main

from .conftest import HAS_CUDA


def test_verify_filtered_variant_passes_and_reports_errors():
    res = CliRunner().invoke(main, ["verify", "--spec", "specs/ci.yaml", "--filter", "*c16_k32_v32_fp32_gb*"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "kda_fwd_triton_c16_k32_v32_fp32_gb_sfp32_bv16" in ln)
    m = re.search(r"rel RMSE o ([\d.e+-]+), state ([\d.e+-]+) \(tol 1e-05\)", line)
    assert line.strip().startswith("pass") and m and float(m.group(1)) < 1e-5 and float(m.group(2)) < 1e-5
    assert "1 passed, 0 failed, 0 skipped" in res.output


def test_verify_skips_what_this_machine_cannot_run_with_the_reason():
    res = CliRunner().invoke(main, ["verify", "--spec", "specs/ascend950.yaml", "--filter", "*_ascend_*bv64"])
    assert res.exit_code == 0, res.output
    assert res.output.count("skip  kda_fwd_ascend_") == 2
    assert "ascend runs on npu, not on cpu" in res.output and "(hardware-validated: no)" in res.output
    if not HAS_CUDA:
        res = CliRunner().invoke(main, ["verify", "--spec", "specs/a100.yaml", "--filter", "*c16_k64*gb_sfp32*"])
        assert "sm80 runs on cuda, not on cpu" in res.output and res.exit_code == 0
