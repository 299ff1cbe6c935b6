"""What each target can be asked for, which templates it renders and how it is built.

This table describes targets (capabilities); the kernel matrix itself is written
only in specs/*.yaml.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TargetInfo:
    name: str
    description: str
    chunks: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    gates: tuple[str, ...]
    states: tuple[str, ...]
    block_v: tuple[int, ...]
    layouts: tuple[str, ...]
    varlen: bool
    gqa: bool
    # (template path under templates/, file name written in generated/<spec>/<variant>/)
    templates: tuple[tuple[str, str], ...]
    # "jit": nothing to compile ahead (Triton); "nvcc": a fatbin per variant;
    # "ascend": CANNBot-DSL translation to AscendC on CPU.
    build: str
    launcher: str  # "module:Class"
    hardware_validated: bool = True
    nvcc_flags: tuple[str, ...] = ()
    # Extra include folders under templates/ whose files every variant's source hashes.
    includes: tuple[str, ...] = ()
    # Selection takes the widest block_v that gives at least this many programs per SM
    # (preferred_block_v first, when it does).
    vsplit_min_waves: float = 2.0
    # block_v measured best on this target wherever it gives vsplit_min_waves programs per SM.
    preferred_block_v: int | None = None
    # Values of the spec's optional `precise` axis (Variant.precise) the target implements.
    precise: tuple[bool, ...] = (False,)
    # Combinations this target cannot build: ({field: value}, reason), shown by `kdagen list -v`.
    rejects: tuple[tuple[tuple[tuple[str, Any], ...], str], ...] = ()
    # A target whose numerics cannot be run here names a twin target implementing the
    # same algorithm; every spec entry of this target also emits the twin variant.
    twin: str | None = None
    # Chunk size to prefer when several fit, from this target's measurements; None: the
    # selection's length heuristic (64 for long sequences, 16 for short ones).
    preferred_chunk: int | None = None
    # How dispatch sees the target (select.py names none); tests require every entry to say.
    devices: tuple[str, ...] | None = None  # torch device types it runs on
    min_compute_capability: tuple[int, int] | None = None  # on CUDA devices
    rank: int | None = None  # lower is preferred among the targets that fit a call
    # Regimes where this target comes before the others unless a tuning file ranks targets there:
    # (head dims, [lo, hi) of tokens per sequence, [lo, hi) of sequences x value heads per SM). Only
    # what the tuning files of every GPU measured agree on.
    preferred_regimes: tuple[tuple[tuple[int, ...], tuple[float, float], tuple[float, float]], ...] = ()
    # (device type, variable, value): on that device type the target needs the variable set
    device_env: tuple[tuple[str, str, str], ...] = ()
    on_demand: bool = True  # may be generated for a call that no spec lists
    # (device type, largest K, why): variants with a larger K do not run on that device type
    device_max_k: tuple[tuple[str, int, str], ...] = ()

    def load_launcher(self):
        mod, _, cls = self.launcher.partition(":")
        return getattr(importlib.import_module(mod), cls)


TARGETS: dict[str, TargetInfo] = {
    "triton": TargetInfo(
        name="triton",
        description="Triton kernels (portable GPUs; CPU through TRITON_INTERPRET=1)",
        chunks=(16, 64),
        # Every multiple of 16 up to 256, K != V included (tiles padded to a power of two;
        # tests/test_triton_design.py renders K = 16, 48, 80, 192); the runtime zero-pads other
        # sizes to the next one.
        head_dims=tuple(range(16, 257, 16)),
        dtypes=("fp32", "bf16", "fp16"),
        gates=("bounded", "unbounded", "precomputed"),
        states=("fp32", "bf16", "none"),
        block_v=(16, 32, 64, 128),
        layouts=("bnsd", "bsnd"),
        varlen=True,
        gqa=True,
        templates=(("triton/kda_fused.py.j2", "kernel.py"),),
        build="jit",
        launcher="kdagen.targets.triton:TritonLauncher",
        # bf16/fp16 tl.dot needs sm_80 MMA; validated on an H200 (sm_90)
        devices=("cuda", "cpu"), min_compute_capability=(8, 0), rank=2,
        device_env=(("cpu", "TRITON_INTERPRET", "1"),),
        # H200, 2026-12-01 (the bench of issue 21): chunk 16 block_v 32 was
        # the fastest variant on four of six rows and within 2% on a fifth; chunk 64's prep is
        # 3-4x slower (T8192 H96 4.19 vs 1.38 ms). Only B1 T2048 H8 favoured chunk 64 (0.205 vs
        # 0.228 ms). Table: benchmarks/results/2026-12-01_h200_triton.md.
        preferred_chunk=16,
        vsplit_min_waves=0.7,
        preferred_block_v=32,
    ),
    "sm80": TargetInfo(
        name="sm80",
        description="CUDA C++ for Ampere (mma.sync, ldmatrix, cp.async); runs on sm_80+ GPUs",
        chunks=(16, 64),
        # 256: chunk 16 with block_v <= 64 only (rejects below); other sizes are zero-padded.
        head_dims=(64, 128, 256),
        dtypes=("bf16", "fp16"),
        gates=("bounded", "unbounded", "precomputed"),
        states=("fp32", "bf16", "none"),
        block_v=(16, 32, 64, 128),
        layouts=("bnsd", "bsnd"),
        varlen=True,
        gqa=True,
        templates=(("sm80/kda_fwd.cu.j2", "kernel.cu"),),
        build="nvcc",
        launcher="kdagen.targets.sm80:Sm80Launcher",
        # sm_80 machine code for Ampere, sm_90 machine code from the same Ampere-level
        # source (sm_80 code alone does not load on Hopper), and PTX for newer GPUs.
        nvcc_flags=(
            "-O3", "-std=c++17", "--use_fast_math",
            "-gencode=arch=compute_80,code=sm_80",
            "-gencode=arch=compute_80,code=sm_90",
            "-gencode=arch=compute_80,code=compute_80",
        ),
        includes=("common", "sm80"),
        # Shared memory per block is capped at an A100's 163 KB (the template asserts it).
        rejects=tuple(((("chunk", 64), ("k", 128), ("block_v", bv)),
                       f"chunk 64 at K = 128 with block_v {bv}: the recurrence needs more than an A100 "
                       f"block's 163 KB of shared memory (block_v <= 32 fits)") for bv in (64, 128)) + (
            ((("chunk", 64), ("k", 256)), "chunk 64 at K = 256: the prep and the recurrence need more than an A100 "
                                          "block's 163 KB of shared memory (one stage alone is about 110 KB)"),
            ((("chunk", 64), ("k", 128), ("v", 256)), "chunk 64 at K = 128, V = 256: the prep needs more than an "
                                                       "A100 block's 163 KB of shared memory"),
            ((("k", 256), ("block_v", 128)), "K = 256 with block_v 128: a block of 9 warps leaves 168 registers per "
                                             "thread and its two 16-row V tiles per warp need 254 (ptxas spills)"),
            ((("chunk", 64), ("precise", True)), "precise at chunk 64: the hi + lo tiles leave block_v 32 no room for "
                                                 "two stages in an A100 block's 163 KB (chunk 16 only)"),
            ((("dtype", "fp16"), ("precise", True)), "precise with fp16: the recurrence forms U0 = P v on bf16 tensor "
                                                     "cores (P in hi + lo), which fp16 v cannot enter (bf16 only)"),
            ((("k", 256), ("block_v", 64), ("precise", True)), "precise at K = 256 with block_v 64: two 16-row "
                                                                  "tiles per warp and their U0 need more than 255 "
                                                                  "registers (ptxas spills in the sm_80 image)"),
            ((("block_v", 128), ("precise", True)), "precise with block_v 128: two 16-row tiles per warp and their U0 "
                                                     "spill 8 bytes at the 168 registers a 9-warp block leaves (ptxas, "
                                                     "sm_90 image at K = 128)"),
        ) + tuple(((("chunk", 16), ("k", a), ("v", b)), "the chunk-16 prep implements K == V")
                  for a in (64, 128, 256) for b in (64, 128, 256) if a != b),
        # kda_layout.cuh's PRECISE record (templates/sm80): the o products in hi + lo bf16.
        precise=(False, True),
        # H200: chunk 16 beat chunk 64 at B1 T8192 H96 (2026-11-30: 1.89 vs 5.08 ms) and at
        # B1 T65536 H24 (5.77 vs 11.45 ms): the chunk-64 prep kernel dominates.
        preferred_chunk=16,
        # H200, 2026-11-30 (split-K recurrence, 2 or 4 warps per 16 V rows): at B1 T8192 H96
        # block_v 64 (192 programs) beat 32 and 128; at B1 T65536 H24 block_v 32 (96 programs)
        # beat 16 and 64. Both are the widest block with at least ~0.7 programs per SM.
        # With the one-barrier recurrence (2400980) block_v 32 and 64 are within 0-6% of each
        # other at T8192 H96, which one leads depending on the run; 32 still wins at H24.
        # With the chain-ordered recurrence step (5347342) block_v 32 beats 64 at T8192 H96 by
        # 10% in two runs (1.407 vs 1.561, 1.399 vs 1.552 ms), so 32 is preferred where it gives
        # 0.7 programs per SM; at T65536 H24, 16 and 32 trade places between runs (within 7%).
        # With four compute warps at block_v 32 (eda65da) 32 leads both rows in one run:
        # T8192 H96 1.237 (16: 1.350, 64: 1.423), T65536 H24 2.771 (16: 3.295, 64: 3.366).
        vsplit_min_waves=0.7,
        preferred_block_v=32,
        devices=("cuda",), min_compute_capability=(8, 0), rank=1,
    ),
    # One fused kernel per variant (templates/sm90/DESIGN.md): bulk copies on mbarriers, the prep
    # in shared memory, wgmma with the fp32 state in registers. block_v: V columns per CTA (one
    # consumer warpgroup per 64); below V the prep is repeated by each of a head's V/block_v CTAs.
    "sm90": TargetInfo(
        name="sm90",
        description="CUDA C++ for Hopper (sm_90a): one fused kernel, bulk copies on mbarriers, wgmma, setmaxnreg",
        chunks=(16,),
        head_dims=(64, 128),
        dtypes=("bf16", "fp16"),
        gates=("bounded", "unbounded", "precomputed"),
        states=("fp32", "bf16", "none"),
        block_v=(64, 128),
        layouts=("bnsd", "bsnd"),
        varlen=True,
        gqa=True,
        templates=(("sm90/kda_fwd.cu.j2", "kernel.cu"),),
        build="nvcc",
        launcher="kdagen.targets.sm90:Sm90Launcher",
        nvcc_flags=("-O3", "-std=c++17", "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a"),
        includes=("common", "sm90"),
        # block_v 64 (the CTA pair) wherever sequences average >= 512 tokens: every such regime of the
        # H200's and the H100 SXM's tuning files picks it, and with tuning off the widest-block rule's
        # 128 took 1.11-2.32x 64's time on five H200 bench rows (session 50). 128 leads only on
        # shorter sequences, where the files say so.
        vsplit_min_waves=0.7,
        preferred_block_v=64,
        # Ranked after every other target: dispatch takes it where a tuning file ranks it first in the
        # call's regime (kdagen/tuning_data holds the H200's and the H100 SXM's), in its preferred
        # regimes where no file ranks targets, else through variant= / KDAGEN_FORCE_VARIANT. Generated
        # on demand like sm80 (nvcc, one build per variant).
        devices=("cuda",), min_compute_capability=(9, 0), rank=5,
        # The measured Hopper files (H200; H100 SXM, session 50) agree on the fastest target in 27 of
        # their 28 D128 (regime, gate) cells; these are the cells where it is sm90 (sm80 below 0.25
        # sequence-heads per SM, and at 512-2048 tokens with 0.25-0.5: eng mix6 H8). The other cell is
        # 64-token sequences, a tie. Without a file sm80 ran sm90's rows 1.15-1.70x slower on the H100.
        preferred_regimes=(((128,), (2048, math.inf), (0.25, math.inf)), ((128,), (512, 2048), (0.5, math.inf)),
                           ((128,), (0, 512), (1.0, 4.0))),
    ),
    "ascend": TargetInfo(
        name="ascend",
        description="CANNBot-DSL kernels for Ascend 950 (NPU ARCH 3510), translated to AscendC on CPU",
        chunks=(64,),
        head_dims=(64, 128),
        dtypes=("bf16",),
        gates=("bounded",),
        states=("fp32",),
        # The seed's adaptive Dv split: one variant per width, selection takes the widest that
        # still gives every AI core a stage-2 task (vsplit_min_waves below).
        block_v=(16, 32, 64, 128),
        layouts=("bnsd", "bsnd"),
        varlen=False,
        gqa=True,
        templates=(("ascend/kda_fwd.py.j2", "kernel.py"),),
        build="ascend",
        launcher="kdagen.targets.ascend:AscendLauncher",
        hardware_validated=False,
        # Stage 2 runs one (batch x head, V slice) task per AI core (both vector subblocks share it).
        # The seed's measured rule (get_dv_base_config: 16/32/64/128 for B*HV <= 4/8/16/more at
        # V = 128): the widest block_v that still gives more than half of the 32 AI cores a task.
        vsplit_min_waves=17.0,
        rejects=((((("k", 64), ("v", 128)), "the Ascend kernel implements K == V"),
                 ((("k", 128), ("v", 64)), "the Ascend kernel implements K == V"))),
        twin="triton_twin",
        devices=("npu",), rank=0,
    ),
    # The Ascend kernel's stage decomposition (token-parallel stage 1 into a workspace,
    # V-split recurrence in stage 2) in Triton: checks its numerics on CPU and GPU.
    # Bounded/precomputed gates only: its diagonal-block anchor is not overflow-free
    # for unbounded gates.
    "triton_twin": TargetInfo(
        name="triton_twin",
        description="Triton twin of the Ascend two-stage kernel (numerics check of the Ascend algorithm)",
        chunks=(64,),
        head_dims=(64, 128),
        dtypes=("bf16", "fp16"),
        gates=("bounded", "precomputed"),
        states=("fp32",),
        block_v=(16, 32, 64, 128),
        layouts=("bnsd", "bsnd"),
        varlen=True,
        gqa=True,
        templates=(("triton/kda_twostage.py.j2", "kernel.py"),),
        build="jit",
        launcher="kdagen.targets.triton_twin:TritonTwinLauncher",
        # a numerics check of the Ascend kernel: serves calls only as the last resort
        devices=("cuda", "cpu"), min_compute_capability=(8, 0), rank=3,
        device_env=(("cpu", "TRITON_INTERPRET", "1"),), on_demand=False,
        device_max_k=(("cuda", 64, "its stage 2 needs more shared memory than a CUDA block has"),),
    ),
}



def get_target(name: str) -> TargetInfo:
    return TARGETS[name]
