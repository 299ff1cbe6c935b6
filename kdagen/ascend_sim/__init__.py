"""A CPU model of the CANNBot-DSL subset the Ascend kernels use, to run a generated kernel.py itself.

The generated kernel imports ``cannbotdsl``; ``load_kernel_module`` executes that same source with
``cannbotdsl`` bound to this package's NumPy implementation (``dsl``), so every statement of the
kernel's program runs: channel produce/consume with the declared depth (a depth-1 channel hands out
the same slot each time), every buffer in its memory space, dtype and physical format (ND or NZ
fractals), casts where the hardware casts (vector vcast, fixpipe out of L0C) and nowhere else (a
DMA between different dtypes is an error, not a silent reinterpretation), fp32 cube accumulation,
and an AI core's two vector subblocks with their own UB (both run every vector statement;
``get_subblock_id`` differs; L0C results reach only the subblock ``dst_subblock`` names).

What it checks besides the numbers: vector ops only inside ``vf`` regions and on UB, aligned vector
accesses within their buffer, copies only between the memory spaces the hardware connects, the
same logical shape on both sides of a copy and of a matmul, subblock-uniform control flow, the two
subblocks never writing different values to one L1/GM element, no GM element written and read by
different cores between two ``global_sync_all`` (the only cross-block ordering the kernel has), and
the same number of global syncs on every block. Fresh on-chip memory holds NaN, so a read of data
nobody wrote poisons the result.

What it cannot check: timing, and the real hardware's memory ordering inside a block (the model
runs the program in order; the DSL compiler derives the pipe synchronisation that makes that
order hold on the NPU, and a compiler bug there is invisible here), the compiler's own address
planning (cross-checked only by total bytes per memory space against the translation), and the
exact rounding of the hardware's exp/div/sqrt and accumulation order.
"""

from .machine import ModelError
from .launch import load_kernel_module

__all__ = ["ModelError", "load_kernel_module"]
