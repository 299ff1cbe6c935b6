"""The sm90 stamp diagnostic's analysis (scripts/sm90_stamps.py runs it on the GPU): the ring's
handoffs, time-stamped by a KDA_SM90_STAMPS=1 build (templates/sm90/kda_sm90_layout.cuh,
StampEvent), as per-chunk segments."""

from __future__ import annotations

# (the order of StampEvent in kda_sm90_layout.cuh)
EVENTS = ["A_WAIT", "A_GO", "A_DONE", "B_WAIT", "B_GO", "B_DONE", "B_FWD", "C_WAIT", "C_GO", "C_DONE",
          "C_TOP", "C_VGO", "B_FULL", "B_DONE1", "B_DONE2", "B_DONE3"]


def preps(cta: int, c: int, pair: bool, p32: bool) -> bool:
    """Whether CTA `cta` preps global chunk c: every chunk unpaired; the pair: chunks of its rank's
    parity; the pair's 32-token step (KDA_SM90_P32): one of the two chunks of each step m = c // 2,
    the second where m and the rank have the same parity (KDA_GCHUNK in kda_sm90_prep.cuh)."""
    if not pair:
        return True
    if not p32:
        return (c & 1) == (cta & 1)
    second = (((c >> 1) ^ cta) & 1) == 0
    return (c & 1) == int(second)


def segments(st: list, pair: bool, c0: int = 0, p32: bool = False) -> dict[str, list[float]]:
    """The cycle's segments per chunk from stamps st[cta][chunk][event] = (clock64, globaltimer ns):
    SM cycles within a CTA, ns across a pair's CTAs (cta ^ 1 is the peer; rank = cta & 1); chunk index
    c of st is global chunk c0 + c (c0 even). p32: the consumers stamp once per 32-token step, at its
    first chunk."""
    ev = {name: i for i, name in enumerate(EVENTS)}

    def clk(cta, c, name):
        return st[cta][c][ev[name]][0]

    def ns(cta, c, name):
        return st[cta][c][ev[name]][1]

    segs: dict[str, list[float]] = {}

    def add(name, x):
        segs.setdefault(name, []).append(x)

    for cta in range(len(st)):
        for c in range(len(st[cta]) - 4):
            own = preps(cta, c0 + c, pair, p32)
            cs = c & ~1 if p32 else c  # the consumer step holding chunk c
            if own:  # this CTA prepped chunk c (the pair: every other one)
                add("A waits (slot, scratch, inputs)", clk(cta, c, "A_GO") - clk(cta, c, "A_WAIT"))
                add("A works (phases 0-1)", clk(cta, c, "A_DONE") - clk(cta, c, "A_GO"))
                add("B waits (scr_full)", clk(cta, c, "B_GO") - clk(cta, c, "B_WAIT"))
                add("B works (phases 2-5)", clk(cta, c, "B_DONE") - clk(cta, c, "B_GO"))
                add("A done -> B starts", clk(cta, c, "B_GO") - clk(cta, c, "A_DONE"))
                ready = max(clk(cta, c, "A_DONE"), clk(cta, c, "B_DONE"))
                if clk(cta, c, "B_DONE1"):
                    add("B's last warp done - B warp 0 done", max(clk(cta, c, f"B_DONE{w}") for w in (1, 2, 3))
                        - clk(cta, c, "B_DONE"))
                add("record done -> consumers start (own)", clk(cta, cs, "C_GO") - ready)
                if pair:
                    peer = cta ^ 1
                    add("forward issued -> peer consumers start [ns]", ns(peer, cs, "C_GO") - ns(cta, c, "B_FWD"))
                    add("B done -> forward issued", clk(cta, c, "B_FWD") - clk(cta, c, "B_DONE"))
                    add("  of which: group B's barrier", clk(cta, c, "B_FULL") - clk(cta, c, "B_DONE"))
            if p32 and c & 1:
                continue
            add("consumers wait (record)", clk(cta, c, "C_GO") - clk(cta, c, "C_WAIT"))
            add("consumers work (products)", clk(cta, c, "C_DONE") - clk(cta, c, "C_GO"))
            add("consumer step (start to start)", clk(cta, c + (2 if p32 else 1), "C_GO") - clk(cta, c, "C_GO"))
            if not clk(cta, c, "C_TOP"):  # (KDA_SM90_STAMPS=2 only)
                continue
            # the rest of the step: what the consumers do outside the record wait and the products
            add("consumers: slot release, o store", clk(cta, c + (2 if p32 else 1), "C_TOP") - clk(cta, c, "C_DONE"))
            add("consumers: S to bf16, v wait", clk(cta, c, "C_VGO") - clk(cta, c, "C_TOP"))
            add("consumers: v fragments, v copies", clk(cta, c, "C_WAIT") - clk(cta, c, "C_VGO"))
    return segs
