"""The launch shim (kdagen/targets/launch_shim.c): compiled into the cache keyed by its source,
its C ABI checked against a C stand-in for libcuda (tests/fake_libcuda.c) with real numbers,
the bound launch over it, the cuda-bindings fallback (no compiler, KDAGEN_LAUNCH_SHIM=0, no
libcuda), driver errors, and on a GPU the same results through both paths."""

from __future__ import annotations

import ctypes
import fnmatch

import pytest
import torch

import kdagen
import kdagen.runtime as rt
import kdagen.targets.sm80 as sm80
from kdagen.errors import KdagenError
from kdagen.paths import cache_dir
from kdagen.targets import launch_shim

from . import fake_cuda
from .fake_cuda import route_launcher, sm80_on_cpu
from .runtime_env import fresh_runtime  # noqa: F401


def test_the_shim_compiles_into_the_cache_keyed_by_its_source(monkeypatch, tmp_path):
    path = launch_shim.build()
    assert path == cache_dir() / "shim" / f"kdagen_launch_shim-{launch_shim.source_key()}.so" and path.is_file()
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    # built once: a second build compiles nothing
    monkeypatch.setattr(launch_shim.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert launch_shim.build() == path
    # another source, another key
    other = tmp_path / "launch_shim.c"
    other.write_text(launch_shim.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(launch_shim, "SOURCE", other)
    launch_shim.source_key.cache_clear()
    try:
        assert launch_shim.library_path() != path
    finally:
        launch_shim.source_key.cache_clear()


def test_a_compile_error_and_a_missing_compiler_are_named(monkeypatch, tmp_path):
    bad = tmp_path / "launch_shim.c"
    bad.write_text("int broken(void) { return }\n")
    monkeypatch.setattr(launch_shim, "SOURCE", bad)
    launch_shim.source_key.cache_clear()
    try:
        with pytest.raises(KdagenError, match=r"launch shim: `.* -shared .*launch_shim\.c -ldl` failed \(1\):"):
            launch_shim.build(tmp_path / "out")
        assert list((tmp_path / "out").glob("*.so")) == []
    finally:
        launch_shim.source_key.cache_clear()
    monkeypatch.setenv("CC", "no-such-compiler-kdagen")
    assert launch_shim.compiler() is None
    with pytest.raises(KdagenError, match=r"launch shim: no C compiler found \(cc, gcc, clang; or set CC\)"):
        launch_shim.build(tmp_path / "out2")


def test_the_package_ships_the_shims_source():
    import tomllib

    root = launch_shim.SOURCE.parents[2]
    st = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert any(fnmatch.fnmatch(launch_shim.SOURCE.name, g) for g in st["package-data"]["kdagen.targets"])


class _Calls:
    """A cuLaunchKernel callback of tests/fake_libcuda.c that keeps every argument as C passed it."""

    def __init__(self) -> None:
        self.got = []
        self.fn = fake_cuda._CALLBACK(self._call)

    def _call(self, f, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        first = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        self.got.append((f, (gx, gy, gz), (bx, by, bz), smem, stream, first, ctypes.string_at(first, 8), extra))
        return 0


def test_the_shims_abi_passes_every_launch_argument():
    """A Pair of arbitrary numbers: both launches reach cuLaunchKernel with exactly them (prep's
    grid x from the call), no prep for grid x 0, and an error code and the failing launch back."""
    shim, clib = fake_cuda.fake_shim()
    calls = _Calls()
    clib.fake_set_callback(calls.fn)
    try:
        params = ctypes.c_uint64(0x1122334455667788)  # what the kernels' argument points at
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        pair = launch_shim.Pair()
        for k, f, grid, block, smem, stream in ((pair.k[0], 0xF00D0001, (999, 3, 5), (128, 1, 1), 5000, 0x7000),
                                                (pair.k[1], 0xF00D0002, (8, 3, 5), (160, 2, 3), 70000, 0x7000)):
            k.func, k.stream, k.args = f, stream, ctypes.addressof(argv)
            k.grid[:], k.block[:], k.smem = grid, block, smem
        pair.failed = -1
        addr = ctypes.c_void_p(ctypes.addressof(pair))
        assert shim.launch_pair(addr, 7) == 0 and pair.failed == -1
        struct = params.value.to_bytes(8, "little")
        want_prep = (0xF00D0001, (7, 3, 5), (128, 1, 1), 5000, 0x7000, ctypes.addressof(params), struct, None)
        want_recur = (0xF00D0002, (8, 3, 5), (160, 2, 3), 70000, 0x7000, ctypes.addressof(params), struct, None)
        assert calls.got == [want_prep, want_recur]
        calls.got.clear()
        assert shim.launch_pair(addr, 0) == 0 and calls.got == [want_recur]  # no chunks: no prep
        # the prep fails: nothing more launched; the recurrence fails: the prep was launched
        calls.got.clear()
        clib.fake_fail(0xF00D0001, 1, 700)
        assert shim.launch_pair(addr, 7) == 700 and pair.failed == 0 and calls.got == []
        clib.fake_fail(0xF00D0002, 1, 1)
        assert shim.launch_pair(addr, 7) == 1 and pair.failed == 1 and calls.got == [want_prep]
    finally:
        clib.fake_set_callback(fake_cuda._CALLBACK())
        clib.fake_fail(None, 0, 0)


def test_a_shim_without_a_driver_says_why(tmp_path):
    with pytest.raises(OSError, match=r"launch shim: dlopen\(.*no-libcuda\.so\): "):
        launch_shim.Shim(launch_shim.build(), libcuda=str(tmp_path / "no-libcuda.so"))
    shim, how = launch_shim.active(libcuda=str(tmp_path / "no-libcuda.so"))
    assert shim is None and how.startswith("launch shim: dlopen(")


@pytest.mark.parametrize("setting", ["unset", "1", "0", "no compiler"])
def test_the_bound_launch_takes_the_shim_unless_off_or_unbuildable(monkeypatch, setting):
    """launch_shim.active over the stand-in libcuda: the bound launch's path follows
    KDAGEN_LAUNCH_SHIM and whether the shim builds; either way the kernels get the same launches."""
    _shim, clib = fake_cuda.fake_shim()
    lib = clib._name
    if setting in ("0", "1"):
        monkeypatch.setenv("KDAGEN_LAUNCH_SHIM", setting)
    if setting == "no compiler":
        monkeypatch.setenv("CC", "no-such-compiler-kdagen")
    var, kw = _case()
    with sm80_on_cpu(var, shim=True) as (la, drv), route_launcher(la):
        monkeypatch.setattr(sm80, "shim_state", lambda: launch_shim.active(libcuda=lib))
        kdagen.kda_prefill(**kw)  # general path, binds
        general = drv.launches[:]
        drv.launches.clear()
        kdagen.kda_prefill(**kw)  # bound
        bound = list(rt._PLANS.values())[-1].fast
        if setting in ("unset", "1"):
            assert bound.shim is not None and bound.launch_path.startswith("kda_prep + kda_recur through the "
                                                                           "launch shim kdagen_launch_shim-")
            assert bound.shim.path.parent == cache_dir() / "shim"
        else:
            why = "KDAGEN_LAUNCH_SHIM=0" if setting == "0" else "launch shim: no C compiler found"
            assert bound.shim is None and f"(launch shim not used: {why}" in bound.launch_path, bound.launch_path
        assert [x[:5] for x in drv.launches] == [x[:5] for x in general] and len(general) == 2
    monkeypatch.setenv("KDAGEN_LAUNCH_SHIM", "maybe")
    with pytest.raises(KdagenError, match="KDAGEN_LAUNCH_SHIM: expected 1 or 0, found 'maybe'"):
        launch_shim.active()


def _case():
    from kdagen.cases import make_case
    from kdagen.variant import Variant

    var = Variant("sm80", 16, 64, 64, "bf16", "bounded", "fp32", 32)
    return var, make_case(var, "cpu", B=2, T=32, H=2, HV=4, seed=0)


@pytest.mark.parametrize("shim", [False, True], ids=["bindings", "shim"])
@pytest.mark.parametrize("kernel", [0, 1], ids=["prep_fails", "recur_fails"])
def test_a_driver_error_in_the_bound_launch_is_named_and_the_general_path_runs(shim, kernel):
    """The driver refuses a kernel's bound launches: last_failure names kernel, grid, block,
    shared memory and the code; the call goes on through the general path (its checked launch
    raises naming the same where the driver refuses it too)."""
    var, kw = _case()
    with sm80_on_cpu(var, shim=shim) as (la, drv), route_launcher(la):
        kdagen.kda_prefill(**kw)
        general = drv.launches[:]
        drv.launches.clear()
        name = ("kda_prep", "kda_recur")[kernel]
        drv.fail(name, 2, 700)  # the bound launch, and its retry at the head of the general path
        o, _ = kdagen.kda_prefill(**kw)
        bound = list(rt._PLANS.values())[-1].fast
        grid, nt, smem = ((2, 2, 4), 128, 5000) if kernel == 0 else ((2, 2, 4), 160, 6000)
        assert bound.last_failure.startswith(f"cuLaunchKernel({name}, grid={grid}, block=({nt}, 1, 1), smem={smem}) "
                                             "failed: CUresult 700 ("), bound.last_failure
        # the prep of both tries when only the recurrence failed, then the general path's launches
        assert [x[:5] for x in drv.launches] == [x[:5] for x in 2 * general[:kernel] + general]
        drv.launches.clear()
        kdagen.kda_prefill(**kw)  # the next call takes the bound launch again
        assert [x[:5] for x in drv.launches] == [x[:5] for x in general]


def test_doctor_and_build_say_which_launch_path_is_active(monkeypatch, capsys):
    from kdagen import cli, doctor

    monkeypatch.setenv("KDAGEN_LAUNCH_SHIM", "0")
    assert doctor._launch_line().endswith("(launch shim not used: KDAGEN_LAUNCH_SHIM=0)")
    cli._build_launch_shim()
    assert capsys.readouterr().out == "launch shim: not built (KDAGEN_LAUNCH_SHIM=0)\n"
    monkeypatch.delenv("KDAGEN_LAUNCH_SHIM")
    cli._build_launch_shim()
    assert capsys.readouterr().out == f"launch shim: {launch_shim.library_path()}\n"
    line = doctor._launch_line()
    try:
        ctypes.CDLL("libcuda.so.1")
        has_driver = True
    except OSError:
        has_driver = False
    if has_driver:
        assert line.startswith("launch: sm80 calls launch through the launch shim kdagen_launch_shim-"), line
    else:  # no libcuda here
        assert line.startswith("launch: sm80 calls launch through ") and "(launch shim not used: launch shim: " \
            "dlopen(libcuda.so.1): " in line, line


# ----------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[64], [300, 0, 17, 700]], ids=["batch", "varlen"])
def test_gpu_shim_and_bindings_launch_the_same(lens, monkeypatch):
    """The bound launch through the shim, then switched to cuda-bindings: the general path's
    results bit for bit, and the float64 reference."""
    from kdagen.reference import kda_reference, rel_rmse

    from .test_fastpath import _gpu_case

    monkeypatch.setenv("KDAGEN_TUNING", "off")  # (an sm80 call: the targets' constants rank sm80 first)

    kw = _gpu_case(lens)
    if len(lens) > 1:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    o_buf, s_buf = torch.empty_like(kw["v"]), torch.empty_like(kw["initial_state"])
    first = [t.clone() for t in kdagen.kda_prefill(**kw, out=o_buf, final_state=s_buf)]  # general path, binds
    bound = list(rt._PLANS.values())[-1].fast
    assert isinstance(bound, sm80.Sm80Bound) and bound.shim is not None, bound.launch_path
    for on in (True, False):
        bound.use_shim(on)
        assert ("through the launch shim" in bound.launch_path) == on
        o_buf.fill_(float("nan"))
        s_buf.fill_(float("nan"))
        res = kdagen.kda_prefill(**kw, out=o_buf, final_state=s_buf)  # the bound launch, on this path
        torch.cuda.synchronize()
        assert bound.last_failure == "" and all(torch.equal(a, b) for a, b in zip(first, res)), on
        assert bound.shim_args if on else bound.stream_args  # that path's prepared arguments were used
    ref = kda_reference(**{n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()
                           if n not in ("cu_seqlens_cpu", "return_chunk_states", "chunk_size", "state_dtype")})
    assert rel_rmse(first[0].cpu(), ref[0]) < 5e-3 and rel_rmse(first[1].cpu(), ref[1]) < 5e-3


@pytest.mark.gpu
def test_gpu_shim_reports_what_the_driver_refused():
    """A kda_recur launch the real driver refuses (more shared memory than any GPU has): the shim
    returns the driver's code, last_failure names it in the general launch's words, and the call
    is served right by the general path."""
    from .test_fastpath import _gpu_case

    kw = _gpu_case([64])
    first = [t.clone() for t in kdagen.kda_prefill(**kw)]
    bound = list(rt._PLANS.values())[-1].fast
    assert bound.shim is not None, bound.launch_path
    kdagen.kda_prefill(**kw)  # makes this stream's Pair
    (addr, prep_x, pair), = bound.shim_args.values()
    pair.k[1].smem = 1 << 30
    res = kdagen.kda_prefill(**kw)
    torch.cuda.synchronize()
    assert bound.last_failure.startswith(f"cuLaunchKernel(kda_recur, grid={bound.recur_grid}, "
                                         f"block=({bound.nt2}, 1, 1), smem={1 << 30}) failed: CUDA_ERROR_INVALID_"), \
        bound.last_failure
    assert all(torch.equal(a, b) for a, b in zip(first, res))
