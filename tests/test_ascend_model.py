"""The Ascend kernels themselves, run on the CPU model of the DSL (kdagen.ascend_sim), against the
float64 reference; and mutations of the kernel that the model must catch.

Every Ascend variant of specs/ascend950.yaml runs three calls that between them cover both
layouts, GQA and batch > 1, the gate sweep (lower_bound -5 and the launcher's limit, ordinary
gates, the strongest decay the bound allows, wide uniform gates), with and without an initial
state, negative eigenvalues, several chunk groups (the state carried between them) and more or
fewer blocks than tasks. Small T (2-3 chunks) keeps each call about a second.
"""

from __future__ import annotations

import json

import pytest
import torch

from kdagen.ascend_sim import ModelError
from kdagen.errors import KdaInputError
from kdagen.generate import render_variant
from kdagen.paths import GENERATED_DIR
from kdagen.targets.ascend import AscendSettings, model_prefill
from kdagen.variant import Variant

from kdagen.cases import make_case, run_and_compare

SPEC_DIR = GENERATED_DIR / "ascend950"
MANIFEST = json.loads((SPEC_DIR / "manifest.json").read_text())
ASCEND_VARIANTS = [Variant.from_dict(e) for e in MANIFEST["variants"] if e["target"] == "ascend"]
LOWER_BOUND_MIN = -10.0  # the shipped kernels' limit; test_lower_bound_limit checks it is the module's


def prefill_on_model(v: Variant, source, settings: AscendSettings):
    def run(variant=None, **kw):
        return model_prefill(v, source, settings=settings, **kw)
    return run


CASES = {
    # name: (make_case arguments, lower_bound, allow_neg_eigval, settings)
    "bsnd_batch2_groups": (dict(B=2, T=128, H=1, HV=1, layout="BSND", gate_scenario="normal"), -5.0, False,
                           AscendSettings(group_chunks=1, blocks=3)),
    "bnsd_gqa_lbmin_strongest_decay": (dict(B=1, T=128, H=1, HV=2, layout="BNSD", gate_scenario="dt=+8"),
                                       LOWER_BOUND_MIN, False, AscendSettings(blocks=2)),
    "bsnd_uniform_gates_no_h0_negeig": (dict(B=1, T=192, H=1, HV=1, layout="BSND", gate_scenario="U(-8,8)",
                                             with_state=False), -5.0, True, AscendSettings(group_chunks=2, blocks=4)),
    # beta as the coefficient b itself (beta_is_logit=False), some of it above 1
    "bsnd_gqa_beta_prob": (dict(B=1, T=128, H=1, HV=2, layout="BSND", beta_prob=True), -5.0, False,
                           AscendSettings(blocks=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("v", ASCEND_VARIANTS, ids=lambda v: v.name)
def test_kernel_on_model_matches_reference(v, case):
    args, lb, neg, settings = CASES[case]
    kw = make_case(v, "cpu", seed=31, **args)
    kw["lower_bound"] = lb
    kw["allow_neg_eigval"] = neg
    if not args.get("with_state", True):
        kw["output_final_state"] = True      # the final state is still checked
    h0 = kw.get("initial_state")
    h0_before = h0.clone() if h0 is not None else None
    errs = run_and_compare(v, kw, prefill=prefill_on_model(v, SPEC_DIR / v.name / "kernel.py", settings))
    assert set(errs) == {"o", "state"}, errs
    if h0 is not None:
        assert torch.equal(h0, h0_before), "the kernel modified the initial state"


def _variant(k: int, bv: int) -> Variant:
    return next(v for v in ASCEND_VARIANTS if v.k == k and v.block_v == bv)


def test_groups_and_blocks_do_not_change_the_result():
    """One group or groups of 1 chunk (state through GM), 1 or 5 blocks: bit-identical outputs."""
    v = _variant(64, 32)
    src = SPEC_DIR / v.name / "kernel.py"
    kw = make_case(v, "cpu", B=1, T=192, H=1, HV=2, seed=5)
    outs = [model_prefill(v, src, settings=s, **kw) for s in
            (AscendSettings(blocks=1), AscendSettings(group_chunks=1, blocks=5), AscendSettings(group_chunks=2, blocks=2))]
    for o, st in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(st, outs[0][1])


def test_lower_bound_limit():
    v = _variant(64, 64)
    src = SPEC_DIR / v.name / "kernel.py"
    from kdagen.ascend_sim import load_kernel_module

    assert load_kernel_module(src).LOWER_BOUND_MIN == LOWER_BOUND_MIN
    kw = make_case(v, "cpu", B=1, T=64, H=1, HV=1, seed=2)
    kw["lower_bound"] = LOWER_BOUND_MIN - 0.5
    with pytest.raises(KdaInputError, match="lower_bound: expected a value >= -10"):
        model_prefill(v, src, **kw)


# ----------------------------------------------------------------------------- mutations

def _mutant(tmp_path, v: Variant, old: str, new: str, count: int = 1):
    """The variant's kernel rendered from the template with one change, in a temp dir."""
    text = render_variant(v)["kernel.py"].decode()
    assert text.count(old) == count, f"mutation site {old!r} found {text.count(old)} times"
    path = tmp_path / v.name / "kernel.py"
    path.parent.mkdir(parents=True)
    path.write_text(text.replace(old, new))
    return path


def test_model_catches_the_l0c_aliasing(tmp_path):
    """The shipped kernel's old defect, re-introduced in a copy of the template: tmp = -C X taken
    from the running inverse's own (depth-1) L0C channel, so it overwrites X. The check fails."""
    v = _variant(64, 64)
    src = _mutant(tmp_path, v, "tmp = self.cacc.produce()", "tmp = self.cinv.produce()")
    kw = make_case(v, "cpu", B=1, T=128, H=1, HV=2, seed=7)
    with pytest.raises(AssertionError, match="rel RMSE of o"):
        run_and_compare(v, kw, prefill=prefill_on_model(v, src, AscendSettings(blocks=2)))
    # the unmodified template passes the same check
    run_and_compare(v, kw, prefill=prefill_on_model(v, SPEC_DIR / v.name / "kernel.py", AscendSettings(blocks=2)))


def test_model_catches_an_unused_second_subblock(tmp_path):
    """Stage 1 with both vector subblocks working on K half 0: half of every L1 operand is never
    written (NaN), and both subblocks write the same workspace rows with different values."""
    v = _variant(64, 64)
    src = _mutant(tmp_path, v, "        sub = cb.get_subblock_id()\n        hq = h // (self.HV // self.H)",
                  "        sub = 0 * cb.get_subblock_id()\n        hq = h // (self.HV // self.H)")
    kw = make_case(v, "cpu", B=1, T=64, H=1, HV=1, seed=8)
    with pytest.raises((ModelError, AssertionError)):
        run_and_compare(v, kw, prefill=prefill_on_model(v, src, AscendSettings(blocks=1)))


def test_model_catches_a_misrouted_l0c_copy(tmp_path):
    """X's rows both sent to subblock 0: subblock 1 builds A^-1 diag(b) from a slot nobody wrote."""
    v = _variant(64, 64)
    src = _mutant(tmp_path, v, "cb.mem_copy(rx, cb.tile_slice(x, (32, C), (s, 0)), dst_subblock=s)",
                  "cb.mem_copy(rx, cb.tile_slice(x, (32, C), (s, 0)), dst_subblock=0)")
    kw = make_case(v, "cpu", B=1, T=64, H=1, HV=1, seed=9)
    with pytest.raises(AssertionError, match="NaN|rel RMSE"):
        run_and_compare(v, kw, prefill=prefill_on_model(v, src, AscendSettings(blocks=1)))


def test_model_catches_a_missing_global_sync(tmp_path):
    """Without the sync after stage 1, stage 2 reads workspace rows other blocks write in the
    same phase: a race on the NPU, an error on the model."""
    v = _variant(64, 64)
    text = render_variant(v)["kernel.py"].decode()
    old = "            cb.global_sync_all()\n            # stage 2"
    assert text.count(old) == 1
    path = tmp_path / "k" / "kernel.py"
    path.parent.mkdir()
    path.write_text(text.replace(old, "            # stage 2"))
    kw = make_case(v, "cpu", B=1, T=64, H=1, HV=2, seed=10)
    with pytest.raises(ModelError, match="same phase|global syncs"):
        model_prefill(v, path, settings=AscendSettings(blocks=2), **kw)


def test_many_heads_k64():
    """K = 64 with HV > 64 (the per-head A_log and dt_bias rows no longer share a scratch row)."""
    v = _variant(64, 64)
    kw = make_case(v, "cpu", B=1, T=64, H=3, HV=66, seed=12)
    run_and_compare(v, kw, prefill=prefill_on_model(v, SPEC_DIR / v.name / "kernel.py", AscendSettings(blocks=8)))
