"""Context-parallel KDA prefill across ranks of a torch.distributed process group (issue 19).

Each rank holds part of the packed tokens of a varlen batch; a sequence may span ranks. The
global token order is cut into slots: in the "contiguous" layout rank r holds slot r, in the
"zigzag" layout (what attention layers use to balance causal work, so a hybrid model's KDA
layers receive it too) rank r holds slots r and 2W - 1 - r, in that order. Built from the global
cu_seqlens (or from fla's FLACPContext, `from_fla`), a `CPContext` tells every rank which pieces
of which sequences it holds. `kda_prefill_cp` (also reached as
`kdagen.kda_prefill(..., cp_context=ctx)` and, with fla's context, `kdagen.chunk_kda`) then runs
on every rank of the group at once:

1. the rank's pieces through the scan engine's step 1 (kdagen.scan.engine.maps_step): each
   segment's transition A and from-zero state B; a piece whose sequence starts on this rank
   starts from its initial state, so the map the rank sends on for it is (A = 0, B = its true
   exit state);
2. one all_gather of every slot's outgoing map (its last piece, when that sequence continues in
   a later slot: [HV, V + K, K] fp32, zeros otherwise), then each piece entering from an
   earlier slot chains the maps of the slots before it that hold its sequence into its entering
   state;
3. o corrected from step 1's outputs and the true entering states (mode "correct", the default),
   or the rank's segments rerun from them (mode "rerun").

A rank with no piece entering from elsewhere and no segment to split runs one plain call, before
the exchange. Communication is torch.distributed only (gloo on CPU, NCCL on GPUs: launch with
NCCL_NVLS_ENABLE=0, NVLink multicast off). Every rank of the group must make the call.

States: `initial_state` holds one row per sequence that STARTS on this rank (ctx.starts, global
indices), the returned final state one row per sequence that ENDS here (ctx.ends); an empty
sequence belongs to the rank whose slot holds its offset (the last non-empty slot for offset T).
With an engine's state pool (`kda_prefill_cp_pool`, or kda_prefill's state_pool/state_indices
with a context) each rank's pool is read for ctx.starts and receives every final state (ctx.pools
"replicated") or those of ctx.ends ("local").
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .errors import KdaInputError
from .inputs import chunk_stride
from .scan.chain import chain_states
from .scan.engine import (_default_prefill, _unpack, correct_step, maps_step, one_piece_v_blocks, pack,
                          planned_segments, rerun_step, scan_launch)
from .scan.layout import balanced, device_ints, split
from .scan.maps import fold, ieee_fp32
from .scan.planner import COSTS, rounds_cost

__all__ = ["Piece", "CPContext", "LAYOUTS", "build_cp_context", "from_fla", "from_ranks", "kda_prefill_cp",
           "exchange_segments", "twin_segments", "twin_wave_cost"]

LAYOUTS = ("contiguous", "zigzag")
POOLS = ("replicated", "local")


@dataclass(frozen=True)
class Piece:
    """The part of sequence `seq` on this rank: local packed tokens [start, end)."""

    seq: int  # global index (a context made from fla's numbers the rank's pieces instead)
    start: int
    end: int
    incoming: bool  # the sequence began in an earlier slot
    outgoing: bool  # the sequence continues in a later slot
    part: int = 0  # which of this rank's slots holds it (index into ctx.slots)
    chain: tuple[int, ...] = ()  # incoming: the earlier slots holding the sequence, in order
    offset: int = 0  # tokens of the sequence before this piece


@dataclass(frozen=True)
class CPContext:
    group: Any  # torch.distributed ProcessGroup (None: the default group)
    rank: int
    world: int
    cu: Optional[tuple[int, ...]]  # global offsets [N + 1] (None in a context made from fla's)
    slot_bounds: tuple[int, ...]  # [slots + 1]: slot s holds global tokens [slot_bounds[s], slot_bounds[s+1])
    pieces: tuple[Piece, ...]  # this rank's, in its buffer's order
    starts: tuple[int, ...]  # sequences whose first token (or empty offset) is on this rank
    ends: tuple[int, ...]  # sequences whose last token (or empty offset) is on this rank
    layout: str = "contiguous"
    slots: tuple[int, ...] = ()  # the global slots this rank holds, in its buffer's order
    pools: str = "replicated"  # which final states (checkpoints) each rank's pool (buffer) receives (POOLS)

    @property
    def rank_bounds(self) -> tuple[int, ...]:
        """[world + 1]: rank r holds global tokens [rank_bounds[r], rank_bounds[r+1]) (contiguous layout)."""
        if self.layout != "contiguous":
            raise KdaInputError(f"rank_bounds: a {self.layout} context's ranks hold {len(self.slots)} intervals "
                                "each; use local_ranges (or take) instead")
        return self.slot_bounds

    @property
    def local_ranges(self) -> tuple[tuple[int, int], ...]:
        """The global token ranges this rank holds, in its buffer's order."""
        return tuple((self.slot_bounds[s], self.slot_bounds[s + 1]) for s in self.slots)

    @property
    def local_tokens(self) -> int:
        return sum(b - a for a, b in self.local_ranges)

    @property
    def local_cu(self) -> list[int]:
        """The pieces' local packed offsets (a varlen cu_seqlens of the rank's tokens)."""
        return [0] + [p.end for p in self.pieces]

    def take(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of a global tensor (T on `dim`), in its buffer's order."""
        parts = [x.narrow(dim, a, b - a) for a, b in self.local_ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def global_range(self, piece: Piece) -> tuple[int, int]:
        """A local piece's global token range."""
        base = sum(b - a for a, b in self.local_ranges[:piece.part])
        a = self.local_ranges[piece.part][0] - base
        return a + piece.start, a + piece.end

    def local_initial_state(self, initial_state: Tensor) -> Tensor:
        """This rank's rows (ctx.starts) of a global [N, ...] initial state."""
        return initial_state[list(self.starts)]

    def slot_owner(self, slot: int) -> tuple[int, int]:
        """(rank, index into that rank's slots) of global slot `slot`."""
        if self.layout == "contiguous":
            return slot, 0
        return (slot, 0) if slot < self.world else (2 * self.world - 1 - slot, 1)

    def holders(self, seq: int) -> list[int]:
        """Slots holding tokens of global sequence `seq`, in order (the ranks, in the contiguous
        layout)."""
        if self.cu is None:
            raise KdaInputError("holders: this context was made from fla's, which has no global offsets")
        return _holders(self.cu[seq], self.cu[seq + 1], self.slot_bounds)


def from_ranks(parts: Sequence[Tensor], contexts: Sequence[CPContext], dim: int = 1) -> Tensor:
    """The global tensor (T on `dim`) from every rank's local one, ranks in order with their
    contexts: the inverse of CPContext.take."""
    pieces = []
    for x, ctx in zip(parts, contexts):
        at = 0
        for a, b in ctx.local_ranges:
            pieces.append((a, x.narrow(dim, at, b - a)))
            at += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim)


def _holders(s: int, e: int, bounds: Sequence[int]) -> list[int]:
    return [x for x in range(len(bounds) - 1) if max(s, bounds[x]) < min(e, bounds[x + 1])]


def _owner(pos: int, bounds: Sequence[int]) -> int:
    """The slot holding global token `pos` (the last non-empty one for pos = T)."""
    n = len(bounds) - 1
    for r in range(n):
        if bounds[r] <= pos < bounds[r + 1]:
            return r
    return max([r for r in range(n) if bounds[r + 1] > bounds[r]] or [n - 1])


def _my_slots(layout: str, rank: int, world: int) -> tuple[int, ...]:
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def _group_rank(group: Any, rank: Optional[int], world: Optional[int], what: str) -> tuple[int, int]:
    if rank is None or world is None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise KdaInputError(f"group: torch.distributed is not initialised; call init_process_group first "
                                f"(or pass rank= and world= to {what})")
        rank = dist.get_rank(group) if rank is None else rank
        world = dist.get_world_size(group) if world is None else world
    if not (0 <= rank < world):
        raise KdaInputError(f"rank: expected 0 <= rank < world={world}, found {rank}")
    return rank, world


def build_cp_context(cu_seqlens: Sequence[int] | Tensor, group: Any = None, *,
                     tokens_per_rank: Optional[Sequence[int]] = None, rank: Optional[int] = None,
                     world: Optional[int] = None, layout: str = "contiguous",
                     pools: str = "replicated") -> CPContext:
    """The context of this rank. cu_seqlens: the global offsets (host values; a tensor is read
    once). layout: "contiguous" (rank r holds tokens_per_rank[r] tokens after rank r - 1's) or
    "zigzag" (T cut into 2 x world slots of balanced sizes, rank r holds slots r and
    2 x world - 1 - r, in that order, as fla's zigzag layout does). tokens_per_rank (contiguous
    only): each rank's token count (default: T split evenly, the remainder to the first ranks).
    rank/world default to the group's (torch.distributed). pools, for calls with a state pool:
    "replicated" (every rank's pool receives every sequence's final state, so pools that start
    as replicas stay replicas, as engines that decode on every rank of the group keep them) or
    "local" (each rank's pool receives the final states of the sequences ending on it); a call's
    checkpoints are kept the same way."""
    if layout not in LAYOUTS:
        raise KdaInputError(f"layout: expected one of {', '.join(LAYOUTS)}, found {layout!r}")
    if pools not in POOLS:
        raise KdaInputError(f"pools: expected one of {', '.join(POOLS)}, found {pools!r}")
    rank, world = _group_rank(group, rank, world, "build a context without one")
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise KdaInputError(f"cu_seqlens: expected non-decreasing global offsets from 0, found "
                            f"{cu if len(cu) <= 12 else cu[:6] + ['...'] + cu[-3:]}")
    T = cu[-1]
    if layout == "zigzag":
        if tokens_per_rank is not None:
            raise KdaInputError("tokens_per_rank: expected None with layout='zigzag' (its 2 x world slots are "
                                "balanced)")
        sizes = balanced(T, 2 * world)
    else:
        sizes = balanced(T, world) if tokens_per_rank is None else [int(x) for x in tokens_per_rank]
        if len(sizes) != world or any(x < 0 for x in sizes) or sum(sizes) != T:
            raise KdaInputError(f"tokens_per_rank: expected {world} counts >= 0 summing to T={T}, found {sizes}")
    bounds = [0]
    for x in sizes:
        bounds.append(bounds[-1] + x)
    slots = _my_slots(layout, rank, world)
    pieces, starts, ends = [], [], []
    base = 0
    for part, slot in enumerate(slots):
        r0, r1 = bounds[slot], bounds[slot + 1]
        for n, (s, e) in enumerate(zip(cu, cu[1:])):
            if s == e:
                if _owner(s, bounds) == slot:
                    pieces.append(Piece(n, base + s - r0, base + s - r0, False, False, part))
                    starts.append(n)
                    ends.append(n)
                continue
            a, b = max(s, r0), min(e, r1)
            if a >= b:
                continue
            chain = tuple(x for x in _holders(s, e, bounds) if x < slot)
            pieces.append(Piece(n, base + a - r0, base + b - r0, s < r0, e > r1, part, chain, a - s))
            if s >= r0:
                starts.append(n)
            if e <= r1:
                ends.append(n)
        base += r1 - r0
    return CPContext(group, rank, world, tuple(cu), tuple(bounds), tuple(pieces), tuple(starts), tuple(ends),
                     layout, slots, pools)


def _host_offsets(t: Any, name: str) -> list[int]:
    if isinstance(t, Tensor):
        return [int(x) for x in t.tolist()]
    raise KdaInputError(f"cp_context.{name}: expected a tensor of local offsets, found {type(t).__name__}")


def from_fla(fla_context: Any, *, rank: Optional[int] = None, world: Optional[int] = None) -> CPContext:
    """kdagen's context for fla's FLACPContext (fla.ops.cp.build_cp_context; "contiguous" or
    "zigzag" layout). fla's context holds only this rank's offsets and how many slots before and
    after share its first and last sequence, which is what the exchange needs; sequences are
    numbered by the rank's pieces (fla takes no initial or final states with a context)."""
    ctx = fla_context
    layout = getattr(ctx, "layout", "contiguous")
    if layout not in LAYOUTS:
        raise KdaInputError(f"cp_context.layout: expected one of {', '.join(LAYOUTS)}, found {layout!r}")
    cu_host = getattr(ctx, "cu_seqlens_cpu", None)
    cu = _host_offsets(cu_host if cu_host is not None else getattr(ctx, "cu_seqlens", None), "cu_seqlens")
    rank, world = _group_rank(getattr(ctx, "group", None), rank, world, "from_fla")
    slots = _my_slots(layout, rank, world)
    if layout == "contiguous":
        meta = [(cu, ctx.pre_num_ranks, ctx.post_num_ranks, ctx.pre_num_conv_tokens)]
        part_len = cu[-1]
    else:
        f, part_len = int(ctx.front_num_seqs), int(ctx.part_len)
        meta = [(cu[:f + 1], ctx.pre_num_ranks_by_part[0], ctx.post_num_ranks_by_part[0],
                 ctx.pre_num_conv_tokens_by_part[0]),
                ([x - part_len for x in cu[f:]], ctx.pre_num_ranks_by_part[1], ctx.post_num_ranks_by_part[1],
                 ctx.pre_num_conv_tokens_by_part[1])]
    if part_len < 1:
        raise KdaInputError(f"cp_context.cu_seqlens: expected at least one local token, found {cu}")
    pieces = []
    base = 0
    for part, (slot, (pcu, pre, post, conv)) in enumerate(zip(slots, meta)):
        if pcu[0] != 0 or pcu[-1] != part_len or any(b <= a for a, b in zip(pcu, pcu[1:])):
            raise KdaInputError(f"cp_context.cu_seqlens: expected increasing local offsets from 0 to {part_len} "
                                f"in part {part}, found {pcu}")
        pre, post, conv = int(pre or 0), int(post or 0), int(conv or 0)
        last = len(pcu) - 2
        for i, (a, b) in enumerate(zip(pcu, pcu[1:])):
            incoming, outgoing = i == 0 and pre > 0, i == last and post > 0
            pieces.append(Piece(len(pieces), base + a, base + b, incoming, outgoing, part,
                                tuple(range(slot - pre, slot)) if incoming else (), conv if i == 0 else 0))
        base += part_len
    bounds = tuple(range(0, len(slots) * world * part_len + 1, part_len))
    return CPContext(getattr(ctx, "group", None), rank, world, None, bounds, tuple(pieces),
                     tuple(i for i, p in enumerate(pieces) if not p.incoming),
                     tuple(i for i, p in enumerate(pieces) if not p.outgoing), layout, slots)


# Segments for a piece on the exchange's path where the twin launch's occupancy is unknown: about
# this many step-1 programs per SM (each of step 1's two calls runs segments x heads x V blocks
# programs), none shorter than EXCHANGE_MIN_TOKENS. On the H200 at B1 T1048576 H8 over 2 emulated
# ranks (64 programs a segment), 8 segments a rank projected 16.5 ms against 19.5 with the one-GPU
# planner's choice, and beat 2, 4 and 16 (benchmarks/NOTES.md, session 29).
EXCHANGE_PROGRAMS_PER_SM = 4
EXCHANGE_MIN_TOKENS = 8192
# Where step 1 is one twin launch (sm80), the count comes from its waves instead (twin_wave_cost):
# S equal segments make S x 2 HV x V-blocks blocks of equal work, at most R resident on an SM.
# The H200 timed kda_recur_twins (c16 bv32, R = 3) at 256K, 512K and 1M tokens H8, S = 3..24:
# every time within 2% of the busiest SM's rounds, a round of c blocks taking (TWIN_LONE + c)
# units of a segment's length; 8 segments (two rounds, the second a third full) took 6.40 ms at
# 512K against 5.53 for 6 (benchmarks/NOTES.md, session 31).
TWIN_LONE = COSTS["h200-engine"].lone
EXCHANGE_MAX_SEGMENTS = 16

# Segments per local piece of this process's last call (for benchmarks and logs).
last_counts: tuple[int, ...] = ()


def exchange_segments(tokens: int, programs: int, sm_count: int) -> int:
    """Segments to cut a piece of `tokens` into when other ranks wait on its map (or it on
    theirs), where the twin launch's occupancy is not known: about EXCHANGE_PROGRAMS_PER_SM
    step-1 programs per SM, `programs` (heads x V blocks) per segment, segments of at least
    EXCHANGE_MIN_TOKENS."""
    want = max(1, round(EXCHANGE_PROGRAMS_PER_SM * sm_count / max(programs, 1)))
    return max(1, min(want, tokens // EXCHANGE_MIN_TOKENS))


def twin_wave_cost(segments: int, blocks: int, blocks_per_sm: int, sm_count: int, lone: float = TWIN_LONE) -> float:
    """Modeled time of a twin recurrence over a piece cut into `segments` equal segments, `blocks`
    blocks per segment, in units of the piece's length: the busiest SM's blocks run in rounds of
    at most blocks_per_sm, a round of c blocks taking (lone + c) / segments (the scan planner's
    rounds_cost)."""
    if segments < 1 or blocks < 1 or blocks_per_sm < 1 or sm_count < 1:
        raise ValueError(f"twin_wave_cost: expected positive counts, found segments={segments}, blocks={blocks}, "
                         f"blocks_per_sm={blocks_per_sm}, sm_count={sm_count}")
    return rounds_cost(-(-segments * blocks // sm_count), blocks_per_sm, lone) / segments


def _exchange_counts(tokens: int, max_segments: int) -> range:
    """The segment counts a piece of `tokens` may take: 1 up to max_segments, segments of at least
    EXCHANGE_MIN_TOKENS."""
    return range(1, max(1, min(max_segments, tokens // EXCHANGE_MIN_TOKENS)) + 1)


def twin_segments(tokens: int, occupancy_of: Callable[[int], Optional[tuple[int, int]]], sm_count: int,
                  max_segments: int = EXCHANGE_MAX_SEGMENTS) -> int:
    """The fewest segments (of at least EXCHANGE_MIN_TOKENS, at most max_segments) whose twin
    recurrence models within 2% of the fastest count. occupancy_of(S): (blocks per segment,
    blocks per SM) of the launch at S segments (the variant, and with it both, may change with S),
    or None where S has none (not priced)."""
    counts = _exchange_counts(tokens, max_segments)
    occ = {S: occupancy_of(S) for S in counts}
    cost = {S: twin_wave_cost(S, *o, sm_count) for S, o in occ.items() if o is not None}
    if not cost:
        raise ValueError(f"twin_segments: no count from 1 to {counts[-1]} has a twin launch")
    best = min(cost.values())
    return min(S for S, c in cost.items() if c <= best * 1.02)


def _twin_occupancy(P, lay, dev) -> Optional[tuple[int, int]]:
    """(blocks per segment, blocks per SM) of the twin launch a step 1 over `lay` would make, or
    None where it makes none or that is not known (not a GPU, not built: pricing never builds)."""
    launch = scan_launch(P.info, lay, P.kw.get("variant")) if dev.type == "cuda" else None
    if not launch or launch.resident_twins < 1:
        return None
    return 2 * P.HV * max(1, P.K // launch.block_v), launch.resident_twins


# segments=None's choice per call signature: a rank repeats its layout call after call, and
# choosing (the one-piece variant's V blocks, the planner) took ~0.7 ms of host time before the
# first kernel (H200, benchmarks/NOTES.md, session 29).
_AUTO_SEGMENTS: dict[tuple, list[int]] = {}


def _shares(total: int, lens: Sequence[int]) -> list[int]:
    """`total` segments shared among pieces of `lens` tokens in proportion to length (largest
    remainders), at least one each."""
    n, tokens = len(lens), max(sum(lens), 1)
    total = max(total, n)
    raw = [total * L / tokens for L in lens]
    c = [max(1, int(r)) for r in raw]
    while sum(c) < total:
        c[max(range(n), key=lambda j: raw[j] - c[j])] += 1
    while sum(c) > total:
        c[max((j for j in range(n) if c[j] > 1), key=lambda j: c[j] - raw[j])] -= 1
    return c


def _auto_segments(P, pieces: Sequence[Piece], costs: str, align: int, mode: str) -> list[int]:
    """Pieces wholly on this rank: the one-GPU planner's segments. A piece another rank waits for
    (or that waits for one) is cut regardless: step 1 reaches the exchange sooner when its segments
    fill the GPU, even where the split costs more work in all. Such pieces (two in the zigzag
    layout, or one entering and one leaving) share step 1's launch, so their count is chosen
    for their combined length and shared among them by length: with a twin launch
    twin_segments' (its waves), otherwise at least exchange_segments."""
    from .select import _sm_count

    lens = [p.end - p.start for p in pieces]
    dev = P.q.device
    sms = _sm_count(dev)
    local_cu = [0] + [p.end for p in pieces]
    segments = list(planned_segments(P.info, local_cu, mode=mode, costs=costs, align=align, variant=P.kw.get("variant")))
    path = [i for i, p in enumerate(pieces) if p.incoming or p.outgoing]
    if not path:
        return segments
    total = sum(lens[i] for i in path)

    def cut(S: int, floor: bool = False) -> list[int]:
        segs = list(segments)
        for i, c in zip(path, _shares(S, [lens[i] for i in path])):
            segs[i] = max(segs[i], c) if floor else c
        return segs

    most = EXCHANGE_MAX_SEGMENTS * len(path)
    occ = {S: _twin_occupancy(P, split(local_cu, cut(S), align), dev)
           for S in _exchange_counts(total, most) if S >= len(path)}
    if any(o is not None for o in occ.values()):
        return cut(twin_segments(total, occ.get, sms, most))
    vb = one_piece_v_blocks(P.info, P.kw.get("variant"))
    return cut(exchange_segments(total, P.HV * vb, sms), floor=True)


def _all_gather(x: Tensor, ctx: CPContext) -> list[Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(ctx.world)]
    dist.all_gather(out, x.contiguous(), group=ctx.group)
    return out


def kda_prefill_cp(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, cp_context: CPContext,
                   segments: int | Sequence[int] | None = None, mode: str = "correct",
                   prefill: Optional[Callable[..., Any]] = None,
                   chain_impl: str = "auto", costs: str = "h200-engine", chunk_grid: str = "sequence",
                   checkpoint_every: Optional[int] = None, checkpoints: Optional[Tensor] = None,
                   checkpoint_offsets: Optional[Tensor] = None, **kw: Any) -> tuple[Optional[Tensor], ...]:
    """This rank's part of a context-parallel kda_prefill. q, k, v, g, beta: the rank's tokens
    in its buffer's order (ctx.take), B = 1, layout "BSND" ([1, T_local, heads, D]) or "BNSD"; no
    cu_seqlens (the context has them). cp_context: a CPContext, or fla's FLACPContext (from_fla).
    Other keywords as kdagen.kda_prefill; initial_state [len(ctx.starts), HV, ...].
    segments: per local piece (or one count) how many scan segments to cut it into; None: the
    one-GPU planner for pieces wholly on this rank, at least exchange_segments for a piece that
    continues on another rank or comes from one. mode: "correct" (default: o corrected from step
    1's outputs in one pass; on the H200 at T1048576 H8 it beat "rerun" at 2 and 4 ranks,
    benchmarks/NOTES.md) or "rerun". chunk_grid: where chunk states fall, "sequence" (every
    chunk_size tokens from the sequence's start, as in the single call: slots must start on that
    grid) or "piece" (from each local piece's start, as fla's intermediate states with a context).
    Returns (o local, final state [len(ctx.ends), HV, ...] or None) like
    kda_prefill, and chunk states with return_chunk_states: the local pieces' chunks, or with
    return_chunk_states=m every m-th chunk's of each piece (ceil(len / (m chunk_size)) rows a
    piece; "sequence" grid: slots start on multiples of m chunk_size).
    Checkpoints (prefix caching): checkpoint_every, checkpoints and checkpoint_offsets as in
    kda_prefill, over the context's global sequences (buffer rows and offsets the same on every
    rank); each rank computes those that fall in its pieces, and every rank's buffer receives
    all of them (ctx.pools "replicated") or its own ("local"). The buffer comes last."""
    ctx = _context(cp_context)
    if checkpoint_every is None and checkpoints is None and checkpoint_offsets is None:
        return _cp_call(q, k, v, g, beta, ctx, segments=segments, mode=mode, prefill=prefill, chain_impl=chain_impl,
                        costs=costs, chunk_grid=chunk_grid, **kw)
    return _cp_checkpoints(q, k, v, g, beta, ctx, checkpoint_every, checkpoints, checkpoint_offsets,
                           segments=segments, mode=mode, prefill=prefill, chain_impl=chain_impl, costs=costs,
                           chunk_grid=chunk_grid, **kw)


def _cp_call(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ctx: CPContext, *,
             segments: int | Sequence[int] | None, mode: str, prefill, chain_impl: str, costs: str,
             chunk_grid: str, **kw: Any):
    """kda_prefill_cp without checkpoints."""
    for name in ("cu_seqlens", "cu_seqlens_cpu", "workspace", "out", "assume_valid"):
        if kw.get(name) is not None and kw.get(name) is not False:
            raise KdaInputError(f"{name}: expected None with cp_context (the context holds the global offsets; "
                                "buffers are the scan's)")
        kw.pop(name, None)
    if mode not in ("rerun", "correct"):
        raise KdaInputError(f"mode: expected 'rerun' or 'correct', found {mode!r}")
    _refuse_capture(q)
    prefill = prefill or _default_prefill()
    layout = str(kw.get("layout", "BSND")).upper()
    t_axis = 1 if layout == "BSND" else 2
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[t_axis] != ctx.local_tokens:
        raise KdaInputError(f"q: expected B = 1 and this rank's {ctx.local_tokens} tokens on the T axis "
                            f"(layout {layout}), found shape {tuple(q.shape)}")
    if isinstance(v, Tensor) and v.dim() == 4 and v.shape[-1] != q.shape[-1]:
        # the scan's check, here too: a rank holding no piece skips it and would wait in the exchange
        raise KdaInputError(f"v: context parallelism carries K x K transitions as V-column states, so it needs "
                            f"V == K; found K={q.shape[-1]}, V={v.shape[-1]}")
    final_buf, chunk_buf = kw.pop("final_state", None), kw.pop("chunk_states", None)
    want_final = bool(kw.pop("output_final_state", False)) or final_buf is not None
    rcs = kw.pop("return_chunk_states", False)
    stride = max(1, chunk_stride(rcs))  # a row per `stride` chunks (return_chunk_states=m)
    want_cs = bool(rcs) or chunk_buf is not None
    h0_user = kw.pop("initial_state", None)
    pieces = ctx.pieces
    n_local = len(pieces)
    C = kw.get("chunk_size")
    if chunk_grid not in ("sequence", "piece"):
        raise KdaInputError(f"chunk_grid: expected 'sequence' or 'piece', found {chunk_grid!r}")
    if want_cs:
        if C is None:
            raise KdaInputError("chunk_size: 16 or 64 required with return_chunk_states")
        # a kept row every C m tokens of each piece: on the sequence's grid when pieces start on it
        cut = _off_grid(ctx, C * stride) if chunk_grid == "sequence" else None
        if cut is not None:
            spacing = f"chunk_size={C}" if stride == 1 else f"chunk_size x return_chunk_states = {C * stride}"
            raise KdaInputError(f"return_chunk_states: a slot boundary falls inside a chunk of sequence {cut[0]} "
                                f"({cut[1]} tokens in); chunk states need slot boundaries on multiples of "
                                f"{spacing} from the sequence's start (tokens_per_rank)")

    # Initial states of the local pieces: the caller's rows for sequences starting here; zeros
    # hold the place of a piece entering from another rank until the exchange.
    h0 = None
    if h0_user is not None:
        if not isinstance(h0_user, Tensor) or h0_user.dim() != 4 or h0_user.shape[0] != len(ctx.starts):
            raise KdaInputError(f"initial_state: expected one row per sequence starting on rank {ctx.rank} "
                                f"([{len(ctx.starts)}, HV, ...], ctx.starts), found "
                                f"{tuple(h0_user.shape) if isinstance(h0_user, Tensor) else type(h0_user).__name__}")
        h0 = h0_user.new_zeros(n_local, *h0_user.shape[1:])
        row = {n: i for i, n in enumerate(ctx.starts)}
        for i, p in enumerate(pieces):
            if not p.incoming:
                h0[i] = h0_user[row[p.seq]]
    parts = len(ctx.slots)
    if n_local == 0:  # nothing here, but the collective needs every rank
        HV, K = v.shape[2 if layout == "BSND" else 1], q.shape[-1]
        _all_gather(torch.zeros(parts, HV, 2 * K, K, dtype=torch.float32, device=q.device), ctx)
        return _empty_result(q, v, HV, K, kw, want_final, want_cs, final_buf, chunk_buf)
    cu_cpu, cu_dev = device_ints(ctx.local_cu, "cpu"), device_ints(ctx.local_cu, q.device)
    cs_arg = stride if want_cs else False
    P = pack(q, k, v, g, beta, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, initial_state=h0,
             output_final_state=True, return_chunk_states=cs_arg, **kw)
    P.cs_stride = stride
    HV, K, dev = P.HV, P.K, q.device
    known = [not p.incoming for p in pieces]
    align = (C or 64) * stride  # segments start on the kept rows' grid, as in the one-GPU scan
    if segments is None:
        key = (tuple(ctx.local_cu), tuple((p.incoming, p.outgoing) for p in pieces), costs, align, dev, mode,
               EXCHANGE_PROGRAMS_PER_SM, EXCHANGE_MIN_TOKENS, EXCHANGE_MAX_SEGMENTS, TWIN_LONE, P.A_log is None,
               tuple(sorted(P.kw.items())),
               tuple((tuple(t.shape), t.dtype) for t in (P.q, P.k, P.v, P.g, P.beta)))
        segments = _AUTO_SEGMENTS.get(key)
        if segments is None:
            segments = _auto_segments(P, pieces, costs, align, mode)
            if len(_AUTO_SEGMENTS) >= 256:
                _AUTO_SEGMENTS.clear()
            _AUTO_SEGMENTS[key] = segments
    lay = split(ctx.local_cu, segments, align)
    global last_counts
    last_counts = lay.counts
    plain = all(known) and not lay.split_any

    # The piece each slot sends on: its last, where that sequence continues in a later slot.
    last_of = {p.part: i for i, p in enumerate(pieces)}
    sends = [(j, i) for j, i in sorted(last_of.items()) if pieces[i].outgoing]

    # 1. Maps (or, with nothing to wait for, the whole local call).
    out_map = torch.zeros(parts, HV, 2 * K, K, dtype=torch.float32, device=dev)
    if plain:
        res = P.call(prefill, lay, initial_state=P.h0, output_final_state=True, return_chunk_states=cs_arg)
        o, finals, cs = res[0], res[1], (res[2] if want_cs else None)
        for j, i in sends:
            out_map[j, :, :K] = finals[i]  # A = 0: the sequence's state leaving this slot, exactly
    else:
        A, B, o_pair, cs_pair = maps_step(P, lay, known, prefill, outputs=(mode == "correct"))
        for j, i in sends:
            segs = slice(lay.first[i], lay.first[i] + lay.counts[i])
            with ieee_fp32():
                Ap, Bp = fold(A[segs], B[segs], dim=0)
            out_map[j, :, :K], out_map[j, :, K:] = Bp, Ap

    # 2. Exchange, and chain the earlier slots' maps into each entering piece's state.
    maps = _all_gather(out_map, ctx)
    S0 = P.h0.clone()
    for i, p in enumerate(pieces):
        if not p.incoming:
            continue
        S = torch.zeros(HV, K, K, dtype=torch.float32, device=dev)
        with ieee_fp32():
            for slot in p.chain:
                r, j = ctx.slot_owner(slot)
                S = S @ maps[r][j, :, K:] + maps[r][j, :, :K]
        S0[i] = S

    # 3. Every local segment from its true entering state.
    if not plain:
        S_in, finals = chain_states(A, B, S0, lay.counts, impl=chain_impl)
        if mode == "rerun":
            o, finals, cs = rerun_step(P, lay, S_in, prefill, want_cs)
        else:
            o, cs = correct_step(P, lay, S_in, known, o_pair, cs_pair)
    ends = device_ints([i for i, p in enumerate(pieces) if not p.outgoing], dev, torch.long)
    return _unpack(P, o, finals[ends], cs, out=None, final_state=final_buf, chunk_states_buf=chunk_buf,
                   want_final=want_final, want_cs=want_cs)


def _off_grid(ctx: CPContext, C: int) -> Optional[tuple[int, int]]:
    """(sequence, tokens in) of the first slot boundary that cuts a sequence off the chunk grid of
    C, or None. Decided from the global offsets where the context has them, so every rank raises
    alike before the exchange (a rank raising alone would leave the others waiting in it)."""
    if ctx.cu is None:  # fla's context: this rank's pieces are all it knows
        return next(((p.seq, p.offset) for p in ctx.pieces if p.incoming and p.offset % C), None)
    for b in ctx.slot_bounds[1:-1]:
        n = bisect.bisect_right(ctx.cu, b) - 1
        if n < len(ctx.cu) - 1 and ctx.cu[n] < b < ctx.cu[n + 1] and (b - ctx.cu[n]) % C:
            return n, b - ctx.cu[n]
    return None


def _cp_checkpoints(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ctx: CPContext, every: Optional[int],
                    buffer: Optional[Tensor], offsets: Optional[Tensor], **kw: Any):
    """kda_prefill_cp with checkpoints: the rank's chunk states on each sequence's own grid (the
    slots must cut sequences on it), kept every checkpoint_stride chunks, hold the checkpoints
    inside its pieces, its final states those at a sequence's end; each goes to its global row."""
    from . import checkpoints as ckpt
    from . import state_pool as pool_io

    _refuse_capture(q)
    ckpt.require_spacing(every)
    if ctx.cu is None:
        raise KdaInputError("checkpoint_every: expected a kdagen context (build_cp_context) with checkpoints; one made "
                            "from fla's FLACPContext numbers no global sequences")
    chunks, user_stride = ckpt.caller_chunks(every, kw.get("chunk_size"), kw.get("return_chunk_states", False),
                                             kw.get("chunk_states"))
    fits = [c for c in chunks if _off_grid(ctx, c) is None]
    if not fits:
        n, off = _off_grid(ctx, chunks[-1])
        raise KdaInputError(f"checkpoint_every: a slot boundary falls inside a chunk of sequence {n} ({off} tokens "
                            f"in); checkpoints on a context need slot boundaries on multiples of the chunk size "
                            f"({' or '.join(map(str, chunks))}) from each sequence's start (tokens_per_rank)")
    C = _planned_chunk(q, k, v, g, beta, ctx, kw, fits) if len(fits) > 1 else fits[0]
    m = user_stride or checkpoint_stride(ctx, C, every)
    HV, st = pool_io.head_dims(q, v, kw.get("layout", "BSND"), kw.get("state_layout", "VK"))
    dtype = next((t.dtype for t in (kw.get("initial_state"), kw.get("final_state"), kw.get("chunk_states"))
                  if isinstance(t, Tensor)), kw.get("state_dtype") or torch.float32)
    lens = [b - a for a, b in zip(ctx.cu, ctx.cu[1:])]
    buffer, offs = ckpt.place(every, lens, HV=HV, state_shape=st, dtype=dtype, device=q.device, buffer=buffer,
                              offsets=offsets, assume_valid=False)
    want_final = bool(kw.get("output_final_state")) or kw.get("final_state") is not None
    res = _cp_call(q, k, v, g, beta, ctx, **dict(kw, chunk_size=C, output_final_state=True, return_chunk_states=m,
                                                 state_dtype=dtype))
    finals, cs = res[1], res[2]
    rows = _checkpoint_rows(ctx, lens, offs, every, C * m, q.device)
    if ctx.pools == "local":
        rows.local.copy(buffer, cs, finals)
    elif rows.width:  # the same on every rank (from the global offsets): all call the collective or none
        # Every rank's rows in the buffer's dtype, each moved once and exactly by an all_gather
        # (padded to the most any rank computes); each lands at its rows in every rank's buffer.
        send = buffer.new_zeros(rows.width, *buffer.shape[1:])
        rows.send.copy(send, cs, finals)
        for part, dst in zip(_all_gather(send, ctx), rows.dst):
            if dst.numel():
                buffer.index_copy_(0, dst, part[:dst.numel()])
    return (res[0], finals if want_final else None, *((cs,) if user_stride else ()), buffer)


@dataclass
class _CheckpointRows:
    local: Any  # checkpoints.Rows: this rank's checkpoints from its chunk states / finals to buffer rows
    send: Any  # checkpoints.Rows: the same to this rank's all_gather rows (replicated)
    width: int  # all_gather rows per rank: the most checkpoints any rank computes
    dst: list  # per rank, the buffer rows of its all_gather rows (int64, device)


_CKPT_ROWS: dict = {}  # (context, lengths, offsets, spacing, device) -> _CheckpointRows: a model's layers repeat it


def _checkpoint_rows(ctx: CPContext, lens: Sequence[int], offs: Sequence[int], every: int, spacing: int,
                     device: torch.device) -> _CheckpointRows:
    """Which rank computes each checkpoint and where it goes. Sequence n's j-th checkpoint (the
    state after pos = (j + 1) every tokens) is computed by the rank holding its token cu[n] + pos,
    from the chunk states kept every `spacing` tokens of that piece, or at pos = L by the rank
    holding the sequence's last token, from its final state; it goes to buffer row offs[n] + j."""
    from . import checkpoints as ckpt

    key = (ctx.cu, ctx.slot_bounds, ctx.slots, ctx.rank, ctx.world, ctx.layout, tuple(lens), tuple(offs), every,
           spacing, device)
    hit = _CKPT_ROWS.get(key)
    if hit is not None:
        return hit
    owned: list[list[int]] = [[] for _ in range(ctx.world)]  # per rank, buffer rows in (n, j) order
    for n, L in enumerate(lens):
        for j in range(L // every):
            pos = (j + 1) * every
            tok = ctx.cu[n] + (pos if pos < L else L - 1)
            slot = bisect.bisect_right(ctx.slot_bounds, tok) - 1  # past empty slots: the one holding tok
            owned[ctx.slot_owner(slot)[0]].append(offs[n] + j)
    # This rank's: (source row in the chunk states or the finals, buffer row), piece by piece
    ends = {n: i for i, n in enumerate(ctx.ends)}
    from_cs, from_final, base = [], [], 0
    for p in ctx.pieces:
        n_tok = p.end - p.start
        for j in range(p.offset // every, (p.offset + n_tok) // every + 1):
            pos = j * every
            if j == 0 or pos < p.offset or pos > lens[p.seq]:
                continue
            if pos < p.offset + n_tok:  # a kept row: pos - p.offset is a multiple of the spacing
                from_cs.append((base + (pos - p.offset) // spacing, offs[p.seq] + j - 1))
            elif pos == lens[p.seq] and not p.outgoing:
                from_final.append((ends[p.seq], offs[p.seq] + j - 1))
        base += -(-n_tok // spacing)
    mine = {row: i for i, row in enumerate(owned[ctx.rank])}
    if sorted(mine) != sorted(r for _, r in from_cs + from_final):
        raise RuntimeError(f"kdagen.cp: rank {ctx.rank}'s checkpoints by position {sorted(mine)} differ from those "
                           f"in its pieces {sorted(r for _, r in from_cs + from_final)} (a bug; please report it)")

    def idx(values: Sequence[int]) -> Tensor:
        return device_ints(list(values), device, torch.long)

    def rows_to(dst_of) -> Any:
        return ckpt.Rows(idx(r[0] for r in from_cs), idx(dst_of(r[1]) for r in from_cs),
                         idx(r[0] for r in from_final), idx(dst_of(r[1]) for r in from_final))

    out = _CheckpointRows(local=rows_to(lambda row: row), send=rows_to(mine.__getitem__),
                          width=max(map(len, owned), default=0), dst=[idx(rows) for rows in owned])
    if len(_CKPT_ROWS) >= 256:
        _CKPT_ROWS.clear()
    _CKPT_ROWS[key] = out
    return out


def _planned_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ctx: CPContext, kw: dict,
                   fits: Sequence[int]) -> int:
    """Of the kernel chunks the slots allow (`fits`), the one the runtime plans for this rank's
    local call without checkpoints (its pieces as sequences, fp32 "VK" states in and out like the
    scan's calls), so that checkpoints keep the call's kernel and o (on the H200 every tuned rule
    picks chunk 16, the precise kernels); fits[0] with a caller's own prefill or no local piece."""
    from . import state_pool as pool_io
    from .runtime import _chunk_of, _with_defaults, kda_prefill

    if kw.get("prefill") not in (None, kda_prefill) or not ctx.pieces:
        return fits[0]
    HV, st = pool_io.head_dims(q, v, kw.get("layout", "BSND"), "VK")
    call = {n: kw[n] for n in ("A_log", "dt_bias", "scale", "lower_bound", "gate", "layout", "use_qk_l2norm",
                               "allow_neg_eigval", "variant", "beta_is_logit") if n in kw}
    h0 = torch.empty(len(ctx.pieces), HV, *st, dtype=torch.float32, device=q.device)  # the plan reads no values
    cu = dict(cu_seqlens=device_ints(ctx.local_cu, q.device), cu_seqlens_cpu=device_ints(ctx.local_cu, "cpu"))
    chunk = _chunk_of(q, k, v, g, beta, _with_defaults(dict(call, **cu, initial_state=h0, output_final_state=True,
                                                            state_layout="VK")))
    return chunk if chunk in fits else fits[0]


def checkpoint_stride(ctx: CPContext, chunk: int, every: int) -> int:
    """The chunk-state stride m a context-parallel call with checkpoints keeps: the largest
    divisor of every / chunk whose grid (m chunk tokens from each sequence's start) every slot
    boundary inside a sequence lies on, so each piece's kept rows hold its checkpoints. m = 1
    (every chunk's state) only where the slots cut sequences off every coarser grid."""
    n = every // chunk
    return max(d for d in range(1, n + 1) if n % d == 0 and _off_grid(ctx, chunk * d) is None)


def kda_prefill_cp_pool(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, cp_context: CPContext,
                        state_pool: Tensor, state_indices: Tensor, **kw: Any) -> tuple[Optional[Tensor], ...]:
    """kda_prefill_cp with an engine's state pool on every rank. state_indices: [N] slot indices
    of the context's global sequences (the same on every rank; -1: a padding sequence, neither
    read nor written). Each rank reads the initial states of the sequences starting on it
    (ctx.starts) from its own state_pool. The final states go, in place, into every rank's pool
    (ctx.pools "replicated", the default: one all_reduce of the [N, HV, ...] finals, each row
    non-zero on one rank only, so the sum is exact) or into the pool of the rank each sequence
    ends on ("local": a sequence spanning ranks reads on its first rank's pool and writes on its
    last's). Indices are read on the host (the context plans there anyway) and checked unless
    assume_valid. Returns kda_prefill_cp's tuple (final states: this rank's ctx.ends rows) with
    final states only when asked."""
    from . import state_pool as pool_io

    ctx = _context(cp_context)
    _refuse_capture(q)  # before the pool's own capture checks, which would misname it
    if ctx.cu is None:
        raise KdaInputError("state_pool: expected a kdagen context (build_cp_context) with a state pool; one made "
                            "from fla's FLACPContext numbers no global sequences (fla takes no states with one)")
    for name in ("initial_state", "final_state"):
        if kw.pop(name, None) is not None:
            raise KdaInputError(f"{name}: expected None with state_pool (the pool holds the initial and final "
                                "states), found a tensor")
    HV, st = pool_io.head_dims(q, v, kw.get("layout", "BSND"), kw.get("state_layout", "VK"))
    io = dict(HV=HV, state_shape=st, device=q.device, state_dtype=kw.pop("state_dtype", None))
    pool_io.check_pool(state_pool, **io)
    N = len(ctx.cu) - 1
    if not isinstance(state_indices, Tensor) or state_indices.dim() != 1 or state_indices.numel() != N \
            or state_indices.dtype not in (torch.int32, torch.int64):
        raise KdaInputError(f"state_indices: expected a 1-D int32 or int64 tensor of {N} slot indices (one per "
                            f"sequence of the context; -1: padding), found {pool_io._found(state_indices)}")
    host = state_indices.tolist()
    if not kw.pop("assume_valid", False):
        pool_io._check(host, state_pool.shape[0])
    io["assume_valid"] = False  # the subsets below are on the host: checking them again costs nothing
    rows_in = pool_io.gather(state_pool, torch.tensor([host[n] for n in ctx.starts], dtype=torch.long),
                             N=len(ctx.starts), **io)
    written = ctx.ends if ctx.pools == "local" else range(N)
    rows_out = pool_io.gather(state_pool, torch.tensor([host[n] for n in written], dtype=torch.long),
                              N=len(written), read=False, **io)
    want_final = bool(kw.pop("output_final_state", False))
    mine = rows_out.final_state if ctx.pools == "local" else None
    res = kda_prefill_cp(q, k, v, g, beta, cp_context=ctx, initial_state=rows_in.initial_state, final_state=mine,
                         output_final_state=True, state_dtype=state_pool.dtype, **kw)
    if ctx.pools == "replicated":
        ends = device_ints(list(ctx.ends), q.device, torch.long)
        rows_out.final_state.copy_(_rows_of_all_ranks(N, tuple(res[1].shape[1:]), ctx, q.device,
                                                      lambda t: t.index_copy_(0, ends, res[1].float())))
    pool_io.scatter(rows_out)
    return (res[0], res[1] if want_final else None, *res[2:])


def _context(x: Any) -> CPContext:
    """kdagen's context of a cp_context argument (kdagen's, or fla's FLACPContext)."""
    if isinstance(x, CPContext):
        return x
    if not _is_fla_context(x):
        raise KdaInputError(f"cp_context: expected a kdagen.cp.CPContext (build_cp_context) or fla's "
                            f"FLACPContext, found {type(x).__name__}")
    return from_fla(x)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _refuse_capture(q: Any) -> None:
    if isinstance(q, Tensor) and _capturing(q.device):
        raise KdaInputError("cp_context: expected no CUDA graph capture (a context-parallel call plans on the host "
                            "and copies its offsets in per call; run it eagerly)")


def _rows_of_all_ranks(rows: int, shape: tuple[int, ...], ctx: CPContext, device: torch.device, fill) -> Tensor:
    """[rows, *shape] fp32 holding every rank's rows: each rank fills the rows it computed
    (fill(t) on zeros) and one all_reduce sums them. Each row is non-zero on one rank only, so
    the sum is exact whatever the destination's dtype (a bf16 value and zeros sum back to it),
    and gloo reduces fp32 everywhere."""
    import torch.distributed as dist

    t = torch.zeros(rows, *shape, dtype=torch.float32, device=device)
    fill(t)
    dist.all_reduce(t, group=ctx.group)
    return t


def _is_fla_context(x: Any) -> bool:
    """fla's FLACPContext (duck-typed: fla need not be importable to build or pass one)."""
    return all(hasattr(x, a) for a in ("cu_seqlens", "pre_num_ranks", "post_num_ranks", "group"))


def _empty_result(q: Tensor, v: Tensor, HV: int, K: int, kw: dict, want_final: bool, want_cs: bool,
                  final_buf: Optional[Tensor], chunk_buf: Optional[Tensor]):
    """Outputs of a rank that holds no piece: an empty o, no states."""
    st = (K, K)
    dtype = kw.get("state_dtype") or torch.float32
    fs = None
    if want_final:
        fs = final_buf if final_buf is not None else torch.empty(0, HV, *st, dtype=dtype, device=q.device)
    o = torch.empty_like(v)
    if want_cs:
        return o, fs, (chunk_buf if chunk_buf is not None else torch.empty(0, HV, *st, dtype=dtype, device=q.device))
    return o, fs
