"""kdagen: a code generator for Kimi Delta Attention (KDA) prefill kernels."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "kda_prefill", "workspace_size", "allocate_outputs", "chunk_kda"]

_RUNTIME = ("kda_prefill", "workspace_size", "allocate_outputs")


def __getattr__(name: str):
    # Import the runtime lazily: the CLI and spec tools must not pay for torch. Importing it
    # also registers torch.ops.kdagen.kda_prefill.
    if name in _RUNTIME:
        from . import runtime

        value = getattr(runtime, name)
        globals()[name] = value  # later lookups skip this function (it costs microseconds per call)
        return value
    if name == "chunk_kda":
        from .fla_compat import chunk_kda

        globals()[name] = chunk_kda
        return chunk_kda
    raise AttributeError(name)


# fla's chunk_kda dispatches to kdagen once fla is imported (kdagen.fla_backend; no torch import here).
from . import fla_backend as _fla_backend  # noqa: E402

_fla_backend.install()
