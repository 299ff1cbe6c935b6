"""The sm90 stamp diagnostic's analysis (scripts/sm90_stamps.py runs it on the GPU): the ring's
handoffs, time-stamped by a KDA_SM90_STAMPS=1 build (templates/sm90/kda_sm90_layout.cuh,
StampEvent), as per-chunk segments."""

from __future__ import annotations

# (the order of StampEvent in kda_sm90_layout.cuh)
EVENTS = ["A_WAIT", "A_GO", "A_DONE", "B_WAIT", "B_GO", "B_DONE", "B_FWD", "C_WAIT", "C_GO", "C_DONE",
          "C_TOP", "C_VGO", "B_FULL", "B_DONE1", "B_DONE2", "B_DONE3", "A_P0", "B_P2", "B_P3", "B_P4"]


def segments(st: list, pair: bool, c0: int = 0) -> dict[str, list[float]]:
    """The cycle's segments per chunk from stamps st[cta][chunk][event] = (clock64, globaltimer ns):
    SM cycles within a CTA, ns across a pair's CTAs (cta ^ 1 is the peer; rank = cta & 1); chunk index
    c of st is global chunk c0 + c."""
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
            own = (not pair) or ((c0 + c) & 1) == (cta & 1)
            if own:  # this CTA prepped chunk c (the pair: every other one)
                add("A waits (slot, scratch, inputs)", clk(cta, c, "A_GO") - clk(cta, c, "A_WAIT"))
                add("A works (phases 0-1)", clk(cta, c, "A_DONE") - clk(cta, c, "A_GO"))
                add("B waits (scr_full)", clk(cta, c, "B_GO") - clk(cta, c, "B_WAIT"))
                add("B works (phases 2-5)", clk(cta, c, "B_DONE") - clk(cta, c, "B_GO"))
                add("A done -> B starts", clk(cta, c, "B_GO") - clk(cta, c, "A_DONE"))
                if clk(cta, c, "A_P0") and clk(cta, c, "B_P4"):  # (the phase stamps)
                    add("  A: phase 0 (to its barrier)", clk(cta, c, "A_P0") - clk(cta, c, "A_GO"))
                    add("  A: phase 1", clk(cta, c, "A_DONE") - clk(cta, c, "A_P0"))
                    add("  B: phase 2 (to its barrier)", clk(cta, c, "B_P2") - clk(cta, c, "B_GO"))
                    add("  B: phase 3", clk(cta, c, "B_P3") - clk(cta, c, "B_P2"))
                    add("  B: phase 4", clk(cta, c, "B_P4") - clk(cta, c, "B_P3"))
                    add("  B: phase 5", clk(cta, c, "B_DONE") - clk(cta, c, "B_P4"))
                ready = max(clk(cta, c, "A_DONE"), clk(cta, c, "B_DONE"))
                if clk(cta, c, "B_DONE1"):
                    add("B's last warp done - B warp 0 done", max(clk(cta, c, f"B_DONE{w}") for w in (1, 2, 3))
                        - clk(cta, c, "B_DONE"))
                add("record done -> consumers start (own)", clk(cta, c, "C_GO") - ready)
                if pair:
                    peer = cta ^ 1
                    add("forward issued -> peer consumers start [ns]", ns(peer, c, "C_GO") - ns(cta, c, "B_FWD"))
                    add("B done -> forward issued", clk(cta, c, "B_FWD") - clk(cta, c, "B_DONE"))
                    add("  of which: group B's barrier", clk(cta, c, "B_FULL") - clk(cta, c, "B_DONE"))
            nxt = c + (2 if pair else 1)  # this CTA's next own chunk (within the loop's range)
            if own and clk(cta, nxt, "A_WAIT"):
                # what each group does between its chunks (the pair: its bulk copies), and its whole cycle
                add("A: done -> next chunk's waits (copies)", clk(cta, nxt, "A_WAIT") - clk(cta, c, "A_DONE"))
                add("A cycle (start to start)", clk(cta, nxt, "A_GO") - clk(cta, c, "A_GO"))
                add("B cycle (start to start)", clk(cta, nxt, "B_GO") - clk(cta, c, "B_GO"))
                if pair:
                    add("B: forward -> next chunk's wait (copies)", clk(cta, nxt, "B_WAIT") - clk(cta, c, "B_FWD"))
            wait = clk(cta, c, "C_GO") - clk(cta, c, "C_WAIT")
            add("consumers wait (record)", wait)
            if pair:
                add(f"consumers wait ({'own' if own else 'peer'} record)", wait)
            add("consumers work (products)", clk(cta, c, "C_DONE") - clk(cta, c, "C_GO"))
            add("consumer step (start to start)", clk(cta, c + 1, "C_GO") - clk(cta, c, "C_GO"))
            if not clk(cta, c, "C_TOP"):  # (KDA_SM90_STAMPS=2 only)
                continue
            # the rest of the step: what the consumers do outside the record wait and the products
            add("consumers: slot release, o store", clk(cta, c + 1, "C_TOP") - clk(cta, c, "C_DONE"))
            add("consumers: S to bf16, v wait", clk(cta, c, "C_VGO") - clk(cta, c, "C_TOP"))
            add("consumers: v fragments, v copies", clk(cta, c, "C_WAIT") - clk(cta, c, "C_VGO"))
    return segs
