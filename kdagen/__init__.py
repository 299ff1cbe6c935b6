"""kdagen: a code generator for Kimi Delta Attention (KDA) prefill kernels."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "kda_prefill"]


def __getattr__(name: str):
    # Import the runtime lazily: the CLI and spec tools must not pay for torch.
    if name == "kda_prefill":
        from .runtime import kda_prefill

        return kda_prefill
    raise AttributeError(name)
