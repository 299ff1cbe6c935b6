"""The one place where dtype, gate and state-form names and their codes are written.

Spec values, canonical names, template constants and torch dtypes all derive from here.
torch is imported lazily: the CLI and the spec tools must not pay for it.
"""

from __future__ import annotations

from typing import Any

DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# C++ element types of the CUDA templates.
CUDA_TYPES = {"fp32": "float", "bf16": "__nv_bfloat16", "fp16": "__half"}
# CANNBot-DSL dtype names (cannbotdsl.dtypes.<name>) of the Ascend templates.
DSL_TYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

GATES = ("bounded", "unbounded", "precomputed")
GATE_TAGS = {"bounded": "gb", "unbounded": "gu", "precomputed": "gp"}  # in canonical names
GATE_IDS = {"bounded": 0, "unbounded": 1, "precomputed": 2}  # KDA_GATE in the kernels

# Dtype of the state tensors a variant reads and writes ("none": no state I/O).
STATES = ("fp32", "bf16", "none")
STATE_IDS = {"none": 0, "fp32": 1, "bf16": 2}  # KDA_STATE in the kernels


def torch_dtype(name: str) -> Any:
    """torch dtype of a dtype or state name ("none" states are computed in float32)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "none": torch.float32}[name]


def dtype_name(dtype: Any) -> str | None:
    """The name of a torch dtype, or None where kdagen has none for it."""
    import torch

    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def template_context() -> dict[str, Any]:
    """What every template may read besides the variant (the maps above)."""
    return {"CUDA_TYPES": CUDA_TYPES, "DSL_TYPES": DSL_TYPES, "GATE_IDS": GATE_IDS, "STATE_IDS": STATE_IDS}
