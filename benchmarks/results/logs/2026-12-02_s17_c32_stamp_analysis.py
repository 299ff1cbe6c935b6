import json, statistics, sys
d = json.load(open(sys.argv[1])); st = d["stamps"]; ev = {n: i for i, n in enumerate(d["events"])}; c0 = d["c0"]
clk = lambda cta, g, n: st[cta][g - c0][ev[n]][0]
segs = {}
add = lambda k, x: segs.setdefault(k, []).append(x)
for cta in range(len(st)):
    r = cta & 1
    for m in range(c0 // 2, (c0 + 64) // 2 - 2):
        g0, g1 = 2 * m, 2 * m + 1
        if (m & 1) == r:
            for h, g in ((0, g0), (1, g1)):
                add(f"A{h} waits", clk(cta, g, "A_GO") - clk(cta, g, "A_WAIT"))
                add(f"A{h} works", clk(cta, g, "A_DONE") - clk(cta, g, "A_GO"))
                add(f"B{h} waits", clk(cta, g, "B_GO") - clk(cta, g, "B_WAIT"))
                add(f"B{h} works", clk(cta, g, "B_DONE") - clk(cta, g, "B_GO"))
            add("A0 start -> B1 done", clk(cta, g1, "B_DONE") - clk(cta, g0, "A_GO"))
            add("A1 done -> B1 start", clk(cta, g1, "B_GO") - clk(cta, g1, "A_DONE"))
            add("B0 done -> B1 start", clk(cta, g1, "B_GO") - clk(cta, g0, "B_DONE"))
            add("B1 done -> own consumers go", clk(cta, g0, "C_GO") - clk(cta, g1, "B_DONE"))
            add("own record: A0 start(prev rec + 2) ", 0)
            add("A period (A0 start to next own A0 start)", clk(cta, g0 + 4, "A_GO") - clk(cta, g0, "A_GO") if g0 + 4 < c0 + 64 else 0)
        add("C waits", clk(cta, g0, "C_GO") - clk(cta, g0, "C_WAIT"))
        add("C works", clk(cta, g0, "C_DONE") - clk(cta, g0, "C_GO"))
        add("C step", clk(cta, g0 + 2, "C_GO") - clk(cta, g0, "C_GO"))
        add("C done -> next C wait", clk(cta, g0 + 2, "C_WAIT") - clk(cta, g0, "C_DONE"))
for k, xs in segs.items():
    xs = sorted(xs)
    print(f"{k:45s} {statistics.median(xs):8.0f}  p10 {xs[len(xs)//10]:8.0f} p90 {xs[9*len(xs)//10]:8.0f}")
print("--- level 2")
segs = {}
for cta in range(len(st)):
    r = cta & 1
    for m in range(c0 // 2, (c0 + 64) // 2 - 2):
        g0 = 2 * m
        if clk(cta, g0, "C_TOP") == 0: continue
        add("top -> vgo (S bf16, v waits, ldmatrix)", clk(cta, g0, "C_VGO") - clk(cta, g0, "C_TOP"))
        add("vgo -> wait (v copies)", clk(cta, g0, "C_WAIT") - clk(cta, g0, "C_VGO"))
        add("wait -> go (record)", clk(cta, g0, "C_GO") - clk(cta, g0, "C_WAIT"))
        add("go -> done (products)", clk(cta, g0, "C_DONE") - clk(cta, g0, "C_GO"))
        add("done -> store (release)", clk(cta, g0, "C_STORE") - clk(cta, g0, "C_DONE"))
        add("store -> next top (o stores)", clk(cta, g0 + 2, "C_TOP") - clk(cta, g0, "C_STORE"))
        if (m & 1) == r:
            add("B0 done -> B0 copies start", clk(cta, g0, "B_FULL") - clk(cta, g0, "B_DONE"))
            add("B0 copies", clk(cta, g0, "B_CPY") - clk(cta, g0, "B_FULL"))
            add("B1 fwd -> B1 copies done", clk(cta, g0 + 1, "B_CPY") - clk(cta, g0 + 1, "B_FWD"))
for k, xs in segs.items():
    xs = sorted(xs)
    print(f"{k:45s} {statistics.median(xs):8.0f}  p10 {xs[len(xs)//10]:8.0f} p90 {xs[9*len(xs)//10]:8.0f}")
