"""KDA problems and their check against the float64 reference: the one harness of every target.

The tests of every target, `kdagen verify`, the benchmarks and the scripts build their inputs
with `make_case` (or `bench_case`) and check a variant's outputs with `run_and_compare`, so a
path one of them exercises is exercised the same way everywhere. `PATHS` names the inputs that
make one path of the contract matter (a stride, a head map, an optional argument); a bug on that
path then changes a result instead of hiding behind inputs that never reach it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from .dtypes import torch_dtype
from .inputs import chunk_stride, kept_chunk_rows
from .reference import kda_reference, rel_rmse
from .variant import Variant

# Gate scenarios: (how g is drawn, dt_bias mean or None for N(0, 1) biases)
GATE_SCENARIOS: dict[str, tuple[str, Optional[float]]] = {
    "normal": ("randn", None),
    "g=-8": ("const:-8", None),
    "g=0": ("const:0", None),
    "g=+8": ("const:8", None),
    "U(-8,8)": ("uniform:8", None),
    "N(0,8)": ("randn:8", None),
    "dt=+4": ("randn", 4.0),
    "dt=-4": ("randn", -4.0),
    "dt=+8": ("randn", 8.0),
    "dt=-8": ("randn", -8.0),
}

# Inputs that make one path matter, each over several chunks with initial, final and chunk
# states (where the variant has state I/O). `T` is in chunks of the variant: 2 means 2C + 5
# tokens, so a partial last chunk follows whole ones.
PATHS: dict[str, dict[str, Any]] = {
    # q, k, v, g, beta as views of one projection buffer: every tensor has its own strides (k's
    # heads 2K apart, g's K + 16 apart, batch rows padded), dt_bias flat [HV*K], int64 offsets.
    "fused_varlen": dict(fused=True, H=2, HV=2, lens_chunks=(2, 1, 0)),
    "fused_bnsd": dict(fused=True, H=2, HV=2, B=2, chunks=1, layout="BNSD", state_layout="KV"),
    "gva_hv4": dict(H=2, HV=4, B=2, chunks=1),  # value head h reads q/k head h // (HV // H)
    "gva_hv6": dict(H=2, HV=6, chunks=1, state_layout="KV"),
    "no_dt_bias": dict(dt_bias=False),
    "lower_bound_-2": dict(lower_bound=-2.0),
    "lower_bound_-20": dict(lower_bound=-20.0),  # spans beyond exp(80) inside a chunk of 16
    "custom_scale": dict(scale=0.37),
    "no_l2norm": dict(use_qk_l2norm=False),
    "neg_eigval": dict(allow_neg_eigval=True),
    # beta passed as the coefficient b itself (fla's and the engines' call), some of it above 1
    "beta_prob": dict(beta_prob=True),
    # Nearly parallel keys, beta near 1, decay near 1: L's entries near 1, so every factor of
    # the chunk inverse matters (random keys make the system almost first order).
    "ill_conditioned": dict(keys="correlated"),
}


# The ill-conditioned case amplifies fp32 rounding through the 16x16 inverses (repeated squaring
# of an L whose powers grow; chunk 64 solves by blocks of 16 too): measured up to 6.6e-5 (o,
# states); a dropped factor of the inverse gives ~1e-2.
ILL_CONDITIONED_TOL = 3e-4


def path_tolerance(v: Variant, path: str) -> Optional[float]:
    """A path's own bound where it differs from `tolerances` (None: the variant's)."""
    return ILL_CONDITIONED_TOL if path == "ill_conditioned" else None


def path_reason(v: Variant, path: str) -> Optional[str]:
    """Why `path` does not apply to `v` (None when it does)."""
    if path.startswith("lower_bound") and v.gate != "bounded":
        return "lower_bound is read by the bounded gate only"
    if path == "no_dt_bias" and v.gate == "precomputed":
        return "the precomputed gate takes no dt_bias"
    if path == "ill_conditioned" and v.dtype != "fp32":
        return "held to an fp32 bound; 16-bit inputs round more than the conditioning shows"
    if (path.startswith("gva") and not v.gqa) or (path == "fused_varlen" and not v.varlen):
        return "the variant has no GQA/varlen"
    return None


def path_case(v: Variant, device, path: str, seed: int = 0, max_chunks: Optional[int] = None) -> dict:
    """kda_prefill kwargs of the named path for `v` (see PATHS); `max_chunks` caps the whole
    chunks before the partial one (the CPU interpreter is slow at chunk 64)."""
    kw = dict(PATHS[path])
    C = v.chunk
    cap = (lambda n: min(n, max_chunks)) if max_chunks is not None else (lambda n: n)
    if "lens_chunks" in kw:
        kw["lens"] = [cap(n) * C + r for n, r in zip(kw.pop("lens_chunks"), (5, 0, 3))]
    else:
        kw["T"] = cap(kw.pop("chunks", 2)) * C + 5
    return make_case(v, device, chunk_states=True, seed=seed, **kw)


def _cumsum(xs) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def make_case(v: Variant, device, *, B: int = 1, T: int = 37, H: int = 1, HV: int = 2, layout: str = "BSND",
              lens: Optional[list[int]] = None, gate_scenario: str = "normal", state_layout: str = "VK",
              with_state: bool = True, chunk_states: bool = False, A_log_scale: float = 0.5,
              fused: bool = False, gb_dtype: str = "fp32", dt_bias: bool = True, lower_bound: float = -5.0,
              scale: Optional[float] = None, use_qk_l2norm: bool = True, allow_neg_eigval: bool = False,
              keys: str = "random", beta_prob: bool = False, seed: int = 0, fused_width: int = 0) -> dict:
    """kda_prefill kwargs for variant `v`: random, never zero, deterministic in `seed`.

    Chunk states are asked for only where the variant has state I/O ("none" variants have none).
    `gb_dtype` is the dtype of g and beta ("fp32", or "input": the variant's); `fused` makes
    every input a view of one projection buffer (so g and beta take the input dtype).
    `fused_width`: the fused buffer's row is at least this many elements (its token stride), so
    that late tokens lie past element 2^31 of a buffer of a few thousand tokens.
    `keys="correlated"` gives the ill-conditioned problem (see PATHS). `beta_prob` passes b
    itself (1.5 sigmoid of the logits: in (0, 1.5)) with beta_is_logit=False. Without the L2 norm,
    q and k are drawn with norms near 1, as a model would give them (b |k|^2 < 2 keeps the
    delta rule stable). The gate form is left for kda_prefill to infer from A_log/lower_bound.
    """
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale

    if lens is not None:
        B, T = 1, sum(lens)
    K, V = v.k, v.v
    dt = torch_dtype(v.dtype)
    kind, dt_val = GATE_SCENARIOS[gate_scenario]
    if keys == "correlated":
        # weak decay: the activated gate is near 0 for every form (see below)
        g = -6.0 + 0.3 * r(B, T, HV, K)
    elif kind == "randn":
        g = r(B, T, HV, K)
    elif kind.startswith("randn:"):
        g = r(B, T, HV, K, scale=float(kind.split(":")[1]))
    elif kind.startswith("uniform:"):
        a = float(kind.split(":")[1])
        g = (torch.rand(B, T, HV, K, generator=gen) * 2 - 1) * a
    else:
        g = torch.full((B, T, HV, K), float(kind.split(":")[1])) + 0.01 * r(B, T, HV, K)
    kw: dict = {}
    if v.gate == "precomputed":
        # a log-decay: <= 0, as large as the bounded gate's range (weak for correlated keys)
        g = -5.0 * torch.sigmoid(g) if keys != "correlated" else -0.01 * torch.rand(B, T, HV, K, generator=gen)
        kw["A_log"] = None
    else:
        kw["A_log"] = r(HV, scale=A_log_scale) if keys != "correlated" else torch.zeros(HV)
        bias = (r(HV, K) if dt_val is None else torch.full((HV, K), dt_val) + 0.1 * r(HV, K))
        if keys == "correlated":
            bias = 0.1 * r(HV, K)
        kw["dt_bias"] = (bias.reshape(-1) if fused else bias) if dt_bias else None
        kw["lower_bound"] = lower_bound if v.gate == "bounded" else None
    q, k = r(B, T, H, K), r(B, T, H, K)
    if keys == "correlated":
        k = r(1, 1, H, K) + 0.3 * k  # cosine between two keys ~0.9 after the L2 norm
    if not use_qk_l2norm:
        q = q * (torch.rand(B, T, H, 1, generator=gen) + 0.5) / math.sqrt(K)
        k = k / k.norm(dim=-1, keepdim=True) * (torch.rand(B, T, H, 1, generator=gen) * 0.5 + 0.5)
    vv = r(B, T, HV, V)
    beta = r(B, T, HV) if keys != "correlated" else 4.0 + 0.3 * r(B, T, HV)
    if beta_prob:
        beta = 1.5 * torch.sigmoid(beta)
        kw["beta_is_logit"] = False
    gb_t = dt if (fused or gb_dtype == "input") else torch.float32
    tensors = dict(q=q.to(dt), k=k.to(dt), v=vv.to(dt), g=g.to(gb_t), beta=beta.to(gb_t))
    if fused:  # built where the kernel runs: a copy across devices would not keep the strides
        tensors = _fused_views({n: t.to(device) for n, t in tensors.items()}, K=K, V=V, pad_tokens=3,
                               min_width=fused_width)
    if layout == "BNSD":
        tensors = {n: (t.transpose(1, 2) if fused else t.transpose(1, 2).contiguous()) for n, t in tensors.items()}
    kw.update(tensors)
    kw["layout"] = layout
    N = len(lens) if lens is not None else B
    if lens is not None:
        kw["cu_seqlens"] = torch.tensor(_cumsum(lens), dtype=torch.int64 if fused else torch.int32)
    has_state = v.state != "none"
    if with_state and has_state:
        shape = (N, HV, V, K) if state_layout == "VK" else (N, HV, K, V)
        kw["initial_state"] = r(*shape, scale=0.5).to(torch_dtype(v.state))
        kw["output_final_state"] = True
    kw["state_layout"] = state_layout
    if chunk_states and has_state:
        kw["return_chunk_states"] = True
        kw["chunk_size"] = v.chunk
        kw["state_dtype"] = torch_dtype(v.state)
    if scale is not None:
        kw["scale"] = scale
    if not use_qk_l2norm:
        kw["use_qk_l2norm"] = False
    if allow_neg_eigval:
        kw["allow_neg_eigval"] = True
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}


def _fused_views(t: dict, *, K: int, V: int, pad_tokens: int, min_width: int = 0) -> dict:
    """The same values as views of one [B, T + pad_tokens, W] buffer, BSND: q's heads K apart,
    k's 2K apart, v's V apart, g's K + 16 apart, beta last; the gaps hold NaN, so a kernel that
    reads a tensor with another one's strides reads NaN. Offsets stay 16-element aligned; W is
    at least `min_width`."""
    B, T, H, _ = t["q"].shape
    HV = t["v"].shape[2]
    parts = [("q", H, K, K), ("k", H, 2 * K, K), ("v", HV, V, V), ("g", HV, K + 16, K)]
    offs, W = {}, 0
    for name, heads, step, _ in parts:
        offs[name] = W
        W += heads * step
    offs["beta"] = W
    W = max(-(-(W + HV) // 16) * 16 + 16, -(-min_width // 16) * 16)
    buf = torch.full((B, T + pad_tokens, W), float("nan"), dtype=t["q"].dtype, device=t["q"].device)
    out = {}
    for name, heads, step, width in parts:
        view = buf[:, :T, offs[name]:offs[name] + heads * step].view(B, T, heads, step)[..., :width]
        view.copy_(t[name])
        out[name] = view
    out["beta"] = buf[:, :T, offs["beta"]:offs["beta"] + HV]
    out["beta"].copy_(t["beta"])
    return out


# ----------------------------------------------------------------------------- tolerances


def tolerances(v: Variant, device) -> dict[str, float]:
    """Bound on the rel RMSE of each output, from measured errors (kdagen_dev/error_table.py).

    Measured on the CPU over every case of the suite (2026-12-01, the chunk-parallel Triton
    template, whose interpreter runs round operands as the GPU's tensor cores do): fp32 variants
    <= 2.4e-7 for every output, held to 2e-6 (1e-5 on a GPU until a GPU run's table says
    otherwise). 16-bit variants: o carries its own rounding (bf16 alone ~3.3e-3; measured up to
    3.4e-3) and so does the state, even where it is carried in fp32, since the recurrence takes it
    as a bf16 operand (measured 2.8e-3; sm80 on the H200 2.4e-3 to 2.9e-3): both held to 5e-3.
    Their chunk states measure up to 3.1e-4 (the early chunks carry little error): held to 2e-3
    on the CPU, 5e-3 on a GPU (not yet measured there).
    """
    # the Triton interpreter is the one CPU path of these kernels (the Ascend model on the CPU
    # emulates the hardware's own precision and keeps the GPU bounds)
    cpu = torch.device(device).type == "cpu" and v.target in ("triton", "triton_twin")
    rounded = 5e-3  # a 16-bit output, or one computed from 16-bit operands
    if v.dtype == "fp32":
        fp32 = 2e-6 if cpu else 1e-5
        state = rounded if v.state == "bf16" else fp32
        return {"o": fp32, "state": state, "chunk_states": state}
    # H200 2026-12-01: Triton's chunk-64 o reached 5.2e-3 at g=-8 (K32; tensor-core rounding of
    # the composed 64x64 inverse), every other 16-bit output of every target <= 4.9e-3
    o = 6e-3 if v.target == "triton" and v.chunk == 64 and not cpu else rounded
    return {"o": o, "state": rounded, "chunk_states": 2e-3 if cpu and v.state != "bf16" else rounded}


# ----------------------------------------------------------------------------- running


def check_chunk_stride(v: Variant, kw: dict, lens: list[int], strides=(2, 3)) -> None:
    """return_chunk_states=m against return_chunk_states=True for variant `v` on the varlen case
    `kw` (sequence lengths `lens`): exactly the states entering chunks 0, m, 2m, ... of every
    sequence, bit-identical, in rows packed per sequence (a NaN-filled buffer of exactly that many
    rows); o and the final states unchanged."""
    from .runtime import kda_prefill

    C = v.chunk
    o1, f1, c1 = kda_prefill(**kw, variant=v.name)
    firsts = [sum(-(-n // C) for n in lens[:i]) for i in range(len(lens))]
    for m in strides:
        want = torch.cat([c1[f + j * m].unsqueeze(0) for f, L in zip(firsts, lens) for j in range(-(-L // (C * m)))])
        buf = torch.full_like(want, float("nan"))
        o, f, c = kda_prefill(**dict(kw, return_chunk_states=m), chunk_states=buf, variant=v.name)
        assert c is buf and torch.equal(c, want), (v.name, m)
        assert torch.equal(o, o1) and torch.equal(f, f1), (v.name, m)


def run_poisoned(v: Optional[Variant], kw: dict, prefill: Optional[Callable] = None):
    """kda_prefill on `kw` forced to `v` (None: the runtime's own choice), writing into NaN-filled
    out= / final_state= / chunk_states= buffers (so an element a kernel forgets to write cannot
    pass as a plausible value): the one place the tests poison outputs. `prefill` replaces
    kda_prefill (e.g. the Ascend CPU model's, which poisons its own outputs)."""
    import kdagen.runtime as rt

    name = v.name if v is not None else None
    if prefill is not None:
        return prefill(**kw, variant=name)
    bufs = rt.allocate_outputs(**kw, fill=float("nan"))
    return rt.kda_prefill(**kw, **bufs, variant=name)


_REF_CACHE: "OrderedDict[str, tuple]" = OrderedDict()
_REF_CACHE_BYTES = [0]
REF_CACHE_LIMIT = 1 << 30  # bytes of cached reference outputs


def _digest(kw: dict) -> str:
    h = hashlib.sha1()
    for name in sorted(kw):
        val = kw[name]
        if isinstance(val, torch.Tensor):
            t = val.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}={val!r};".encode())
    return h.hexdigest()


def reference(kw: dict) -> tuple:
    """The float64 reference (o, final state, chunk states) of kda_prefill kwargs `kw`, computed
    on the CPU; cached by the inputs' values, since variants that differ only in chunk, V-split
    or target share their inputs."""
    ref_kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    ref_kw.pop("state_dtype", None)
    ref_kw.pop("cu_seqlens_cpu", None)  # (the same offsets as cu_seqlens)
    cs = ref_kw.pop("chunk_size", None)
    want_cs = ref_kw.pop("return_chunk_states", False)
    ref_kw["chunk_states_size"] = cs if want_cs else None
    key = _digest(ref_kw)
    hit = _REF_CACHE.get(key)
    if hit is not None:
        _REF_CACHE.move_to_end(key)
        return hit
    out = kda_reference(**ref_kw)
    nbytes = sum(t.numel() * 8 for t in out if t is not None)
    _REF_CACHE[key] = out
    _REF_CACHE_BYTES[0] += nbytes
    while _REF_CACHE_BYTES[0] > REF_CACHE_LIMIT and len(_REF_CACHE) > 1:
        _, old = _REF_CACHE.popitem(last=False)
        _REF_CACHE_BYTES[0] -= sum(t.numel() * 8 for t in old if t is not None)
    return out


def errors(v: Variant, kw: dict, out) -> dict[str, float]:
    """Rel RMSE of every output of a kda_prefill call (o, final state, chunk states) against the
    reference; inf where an output is missing, misshapen or not finite."""
    ro, rs, rc = reference(kw)

    def err(x, ref) -> float:
        if x is None or tuple(x.shape) != tuple(ref.shape):
            return math.inf
        return rel_rmse(x.cpu(), ref)

    errs = {"o": err(out[0], ro)}
    if rs is not None:
        errs["state"] = err(out[1], rs)
    if kw.get("return_chunk_states"):
        m = chunk_stride(kw["return_chunk_states"])
        if m > 1 and rc is not None:
            rc = rc[kept_rows(kw, m)]  # the reference keeps every chunk's state
        errs["chunk_states"] = err(out[2] if len(out) > 2 else None, rc)
    return errs


def kept_rows(kw: dict, m: int) -> list[int]:
    """The rows of every-chunk states that a call of kwargs `kw` with return_chunk_states=m keeps."""
    from .checkpoints import host_lengths

    q = kw["q"]
    T = q.shape[2] if str(kw.get("layout", "BSND")).upper() == "BNSD" else q.shape[1]
    lens = host_lengths(q.shape[0], T, kw.get("cu_seqlens"), kw.get("cu_seqlens_cpu"), "return_chunk_states")
    return kept_chunk_rows(lens, kw["chunk_size"], m)


def _record(v: Variant, kw: dict, errs: dict, tol: dict) -> None:
    """KDAGEN_ERRORS=path appends one JSON line per comparison (the measured errors behind the
    tolerances above; kdagen_dev/error_table.py summarises them)."""
    path = os.environ.get("KDAGEN_ERRORS")
    if not path:
        return
    dev = next(t.device.type for t in kw.values() if isinstance(t, torch.Tensor))
    row = {"variant": v.name, "target": v.target, "dtype": v.dtype, "state": v.state, "device": dev,
           "case": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "errors": errs,
           "tolerance": {k: tol[k] for k in errs}}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def run_and_compare(v: Variant, kw: dict, tol: Optional[float | dict[str, float]] = None, out=None,
                    prefill: Optional[Callable] = None) -> dict:
    """Run `v` on `kw` with poisoned outputs (or check `out`, the outputs of such a run) and assert
    every output is within its tolerance of the float64 reference. Returns the errors. `prefill`:
    see run_poisoned."""
    if out is None:
        out = run_poisoned(v, kw, prefill)
    dev = next(t.device for t in kw.values() if isinstance(t, torch.Tensor))
    bounds = tolerances(v, dev)
    if tol is not None:
        bounds = {k: (tol[k] if isinstance(tol, dict) else tol) for k in bounds}
    errs = errors(v, kw, out)
    _record(v, kw, errs, bounds)
    bad = {k: e for k, e in errs.items() if not e < bounds[k]}
    assert not bad, (f"{v.name}: rel RMSE of " + ", ".join(f"{k} {e:.3e} (bound {bounds[k]:.0e})" for k, e in errs.items()))
    return errs


# ----------------------------------------------------------------------------- benchmarks


def bench_inputs(T: Optional[int] = None, H: int = 8, lens: Optional[list[int]] = None, D: int = 128, seed: int = 0,
                 dev="cuda", B: int = 1, dtype: str = "bf16", gate: str = "bounded",
                 HV: Optional[int] = None, gate_fp32: bool = False, beta_prob: bool = False) -> tuple[dict, Any]:
    """The benchmarks' tensors and cu_seqlens apart: q, k [B, T, H, D], v, g [B, T, HV, D] and
    beta [B, T, HV] in `dtype` (HV: value heads, default H; more than H is GQA), A_log and dt_bias
    (None for the precomputed gate, whose g is then a log-decay in the bounded gate's range), an
    fp32 initial state [N, HV, D, D] and the gate form (DESIGN.md section 5's setting). gate_fp32: g and
    beta in fp32 instead (engines pass fla's fused_kda_gate output so). Drawn on `dev`; callers pass the
    other arguments themselves. beta_prob: beta as sigmoid(logits), for beta_is_logit=False."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    if lens is not None:
        T = sum(lens)
    dt = torch_dtype(dtype)

    def r(*s):
        return torch.randn(*s, generator=gen, device=dev)

    HV = H if HV is None else HV
    g = r(B, T, HV, D)
    if gate == "precomputed":
        g = -5.0 * torch.sigmoid(g)
    gdt = torch.float32 if gate_fp32 else dt
    kw = dict(q=r(B, T, H, D).to(dt), k=r(B, T, H, D).to(dt), v=r(B, T, HV, D).to(dt), g=g.to(gdt),
              beta=(torch.sigmoid(r(B, T, HV)) if beta_prob else r(B, T, HV)).to(gdt),
              A_log=torch.rand(HV, generator=gen, device=dev) if gate != "precomputed" else None,
              dt_bias=r(HV, D) * 0.1 if gate != "precomputed" else None,
              initial_state=r(len(lens) if lens else B, HV, D, D) * 0.1, gate=gate)
    cu = torch.tensor(_cumsum(lens), dtype=torch.int32, device=dev) if lens else None
    return kw, cu


def bench_case(T: Optional[int] = None, H: int = 8, lens: Optional[list[int]] = None, D: int = 128, seed: int = 0,
               device="cuda", B: int = 1, dtype: str = "bf16", gate: str = "bounded") -> dict:
    """bench_inputs as kda_prefill kwargs: lower_bound -5 (bounded gate), the final state asked
    for, cu_seqlens in."""
    kw, cu = bench_inputs(T, H, lens, D, seed, device, B, dtype, gate)
    kw.update(output_final_state=True, lower_bound=-5.0 if gate == "bounded" else None)
    if cu is not None:
        kw["cu_seqlens"] = cu
    return kw
