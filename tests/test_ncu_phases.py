"""kdagen_dev/ncu_phases.py (scripts/ncu_phases.py) on a small synthetic ncu source export (CPU)."""

from kdagen_dev import ncu_phases

HEADER = '"Address","Source","# Samples","Instructions Executed","stall_barrier","stall_long_sb","stall_long_sb (Not Issued)"'
ROWS_A = [  # 4 warps: the first instruction runs 4 times
    ('"0x0","LDG.E R0, [R2]","10","4","0","0","0"'),
    ('"0x10","FADD R1, R0, R0","30","4","0","25","20"'),
    ('"0x20","BAR.SYNC.DEFER_BLOCKING 0x0","20","4","18","0","0"'),
    ('"0x30","EXIT","40","2","0","0","0"'),
]


def test_phases_split_at_barriers_and_normalise_per_warp(tmp_path):
    src = tmp_path / "src.csv"
    src.write_text("\n".join(['"Kernel Name","kda_prep",', HEADER, *ROWS_A,
                              '"Kernel Name","kda_recur",', HEADER, '"0x0","EXIT","5","8","0","0","0"']) + "\n")
    kernels = ncu_phases.read_kernels(src)
    assert list(kernels) == ["kda_prep", "kda_recur"] and len(kernels["kda_prep"]) == 4
    ph = ncu_phases.phases(kernels["kda_prep"])
    assert [(p.static, p.executed, p.samples) for p in ph] == [(3, 12, 60), (1, 2, 40)]
    assert ph[0].stalls == {"barrier": 18, "long_sb": 25}  # the Not Issued column is not a reason
    lines = ncu_phases.report("kda_prep", kernels["kda_prep"]).splitlines()
    assert lines[0].startswith("kda_prep: 4 instructions") and "100 stall samples" in lines[0]
    assert lines[2].split()[:4] == ["0", "3", "3", "60.0%"]  # 12 executed over 4 warps; 60 of 100 samples
    assert "long_sb 25.0" in lines[2] and "barrier 18.0" in lines[2]
