"""Where the sm90 kernel's chunk time goes: the ring's handoffs, time-stamped (GPU, diagnostic).

    python scripts/fatbin_ab.py --variant V --build /tmp/st.fatbin -DKDA_SM90_STAMPS=1
    python scripts/sm90_stamps.py --variant V --fatbin /tmp/st.fatbin [--T 16384 --H 48]

A KDA_SM90_STAMPS build has one thread of each role write clock64() and %globaltimer at the ring's
handoffs (templates/sm90/kda_sm90_layout.cuh: StampEvent) for 64 chunks of the first 8 CTAs. This
prints the median of each segment over those chunks: how long each role waits and works, how long a
finished record takes to wake the consumers, and (the pair) how long a forwarded record takes to reach
the peer. Clock64 serves within a CTA (one SM); %globaltimer across a pair's CTAs.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True)
    ap.add_argument("--fatbin", required=True, help="a -DKDA_SM90_STAMPS=1 build of --variant")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=48)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dump", help="also write the raw stamps [cta][chunk][event] = (clock64, ns) as JSON here")
    a = ap.parse_args()

    import torch

    from kdagen.cases import bench_case
    from kdagen.targets.sm90 import Sm90Launcher, build_params
    from kdagen_dev.ab import entry
    from kdagen_dev.launch import capture_call
    from kdagen_dev.sm90_stamps import EVENTS, segments

    var = entry(a.variant).variant
    call = capture_call(bench_case(a.T, a.H, D=var.k, gate=var.gate), var.name)
    la = Sm90Launcher(var, Path(a.fatbin))
    mod = la._module(call.q.device)[0]
    C0, N, CTAS, nev = struct.unpack("<4i", mod.read_global("kda_stamp_meta", 16))  # (not a stamps build: raises)
    if nev != len(EVENTS):
        raise SystemExit(f"{a.fatbin} stamps {nev} events, kdagen_dev/sm90_stamps.py names {len(EVENTS)}")
    p, keep, o_run = build_params(call, var, var.name)
    buf = torch.zeros(CTAS * N * len(EVENTS) * 2, dtype=torch.int64, device=call.q.device)
    p.ws = buf.data_ptr()
    for _ in range(a.calls):  # the last call's stamps are kept
        buf.zero_()
        la.launch(call, p)
    torch.cuda.synchronize()
    del keep, o_run
    st = buf.view(CTAS, N, len(EVENTS), 2).cpu().tolist()
    if a.dump:
        import json

        Path(a.dump).write_text(json.dumps({"variant": var.name, "T": a.T, "H": a.H, "c0": C0, "events": EVENTS,
                                            "stamps": st}))
    if not any(st[0][0][e][0] for e in range(len(EVENTS))):
        print("no stamps written: is --fatbin a KDA_SM90_STAMPS=1 build, and the sequence longer than "
              f"{C0 + N} chunks?")
        return 1
    segs = segments(st, pair=var.block_v == 64 and var.k == 128, c0=C0)
    print(f"{var.name} B1 T{a.T} H{a.H}: medians over chunks {C0}..{C0 + N - 5} of {CTAS} CTAs (SM cycles "
          "unless marked)")
    for name, xs in segs.items():
        print(f"  {name:46s} {statistics.median(xs):9.0f}   (p10 {sorted(xs)[len(xs) // 10]:.0f}, "
              f"p90 {sorted(xs)[9 * len(xs) // 10]:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
