"""Build FlashKDA (github.com/MoonshotAI/FlashKDA) as the peer of `kdagen bench --compare flashkda` on a GPU
machine that reaches no package registry (a developer tool, not a test; FlashKDA's code stays outside this tree).

    # 1. anywhere with nvcc >= 12.8 and PyPI (no GPU needed): compile FlashKDA's CUDA part for sm_90a with
    #    nvidia-cutlass's headers and pack what the GPU machine needs
    git clone https://github.com/MoonshotAI/FlashKDA /tmp/FlashKDA
    python scripts/flashkda_peer.py prepare --src /tmp/FlashKDA --out .gpu/flashkda.tar.xz
    # 2. on the GPU machine (its own torch, no network): compile the torch binding and put it on the path
    python3 scripts/flashkda_peer.py bind --pack .gpu/flashkda.tar.xz --dir /tmp/flashkda
    export PYTHONPATH=/tmp/flashkda:$PYTHONPATH    # `import flash_kda` now works; kdagen bench finds it

Two steps because the CUDA part takes ~2 minutes of nvcc (device time is scarce) while the binding must be
compiled against the GPU machine's torch (~30 s there). The nvcc flags are those of FlashKDA's setup.py; the
CUTLASS headers come from the nvidia-cutlass wheel instead of FlashKDA's pinned submodule.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

CUTLASS_WHEEL = "nvidia-cutlass==4.2.0.0"
NVCC_FLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-U__CUDA_NO_HALF_OPERATORS__",
              "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--use_fast_math", "--ptxas-options=-v,--register-usage-level=10,--warn-on-spills", "-lineinfo"]


def _cutlass_include(dest: Path, given: str | None) -> None:
    """CUTLASS/CuTe headers into dest: from `given` (an include folder) or from the nvidia-cutlass wheel."""
    if given:
        shutil.copytree(given, dest)
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, CUTLASS_WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("nvidia_cutlass-*.whl"))
        prefix = "cutlass_library/source/include/"
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(prefix) and not name.endswith("/"):
                    out = dest / name[len(prefix):]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(z.read(name))


def prepare(src: Path, out: Path, arch: str, cutlass_include: str | None) -> None:
    for need in ("csrc/smxx/fwd_launch.cu", "csrc/flash_kda.cpp", "flash_kda/__init__.py"):
        if not (src / need).is_file():
            sys.exit(f"--src {src}: not a FlashKDA checkout (no {need})")
    rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        shutil.copytree(src / "csrc", stage / "csrc")
        shutil.copytree(src / "flash_kda", stage / "flash_kda")
        print(f"CUTLASS headers ({cutlass_include or CUTLASS_WHEEL}) ...", flush=True)
        _cutlass_include(stage / "cutlass_include", cutlass_include)
        cmd = ["nvcc", "-c", str(stage / "csrc/smxx/fwd_launch.cu"), "-o", str(stage / "fwd_launch.o"),
               f"-I{stage / 'cutlass_include'}", f"-I{stage / 'csrc'}", *NVCC_FLAGS,
               "-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        print(f"nvcc fwd_launch.cu for sm_{arch} (about 2 minutes) ...", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        (stage / "nvcc.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            sys.exit(f"nvcc failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
        # importlib.metadata then names the build in kdagen bench's report
        meta = stage / f"flash_kda-0.0.1+{rev}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash_kda\nVersion: 0.0.1+{rev}\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz") as t:
            t.add(stage, arcname=".")
    print(f"packed FlashKDA {rev} (sm_{arch}) into {out} ({out.stat().st_size / 2**20:.1f} MiB)")


def bind(pack: Path, dest: Path) -> None:
    from torch.utils.cpp_extension import load  # the GPU machine's torch

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(pack) as t:  # the package, its metadata and the binding side by side on one path entry
        t.extractall(dest, filter="data")
    print("compiling FlashKDA's torch binding (about 30 s) ...", flush=True)
    load(name="flash_kda_C", sources=[str(dest / "csrc/flash_kda.cpp")],
         extra_include_paths=[str(dest / "cutlass_include"), str(dest / "csrc")],
         extra_ldflags=[str(dest / "fwd_launch.o")], extra_cflags=["-O3"], build_directory=str(dest),
         with_cuda=True, verbose=False)
    print(f"flash_kda ready: export PYTHONPATH={dest}:$PYTHONPATH")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="compile FlashKDA's CUDA part and pack it (no GPU needed)")
    p.add_argument("--src", type=Path, required=True, help="a FlashKDA checkout")
    p.add_argument("--out", type=Path, default=Path(".gpu/flashkda.tar.xz"))
    p.add_argument("--arch", default="90a", help="FlashKDA's SM: 90a (H100/H200/H800), 100a, 103a, 120a")
    p.add_argument("--cutlass-include", help="a CUTLASS include folder instead of the nvidia-cutlass wheel's")
    b = sub.add_parser("bind", help="compile the torch binding on the GPU machine")
    b.add_argument("--pack", type=Path, default=Path(".gpu/flashkda.tar.xz"))
    b.add_argument("--dir", type=Path, default=Path("/tmp/flashkda"))
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.src.expanduser().resolve(), a.out, a.arch, a.cutlass_include)
    else:
        bind(a.pack, a.dir)


if __name__ == "__main__":
    main()
