"""Capture a step into a CUDA graph the way engines do: warm-up calls on a side stream (plans,
modules and launch parameters made outside the capture), then one captured call."""

from __future__ import annotations

from typing import Callable

import torch


def capture(step: Callable[[], None], warmup: int = 2) -> "torch.cuda.CUDAGraph":
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
