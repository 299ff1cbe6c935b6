"""Exact parallel scan over sequence segments (issue 17) and the pieces context parallelism
(kdagen.cp, issue 19) exchanges between ranks.

- ``maps``: the chunk recurrence as affine maps of the state (torch reference).
- ``layout``: sequences cut into segments on chunk boundaries.
- ``reference``: the three-step scheme in torch, with kda_reference's contract.
- ``chain``: the sequential pass over segment boundary states (torch, and one Triton kernel).
- ``engine``: the three-step scheme through kdagen.kda_prefill (any target's kernels).
- ``planner``: whether to split, and into how many segments, from a cost model.
"""
