"""kdagen: a code generator for Kimi Delta Attention (KDA) prefill kernels."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "kda_prefill", "workspace_size", "allocate_outputs"]

_RUNTIME = ("kda_prefill", "workspace_size", "allocate_outputs")


def __getattr__(name: str):
    # Import the runtime lazily: the CLI and spec tools must not pay for torch. Importing it
    # also registers torch.ops.kdagen.kda_prefill.
    if name in _RUNTIME:
        from . import runtime

        value = getattr(runtime, name)
        globals()[name] = value  # later lookups skip this function (it costs microseconds per call)
        return value
    raise AttributeError(name)
