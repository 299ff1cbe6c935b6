#!/usr/bin/env bash
# Dev helper for the sm80 target (until/independent of the ninja build):
#   scripts/sm80_dev.sh build [OUTDIR] [VARIANT_FILTER...]   render + nvcc every listed variant
# Variants are "c,k,v,dtype,gate,state,bv" tuples; default: a small representative set.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.sm80dev}; shift || true
PY=${PY:-python3}; [ -x .venv/bin/python ] && PY=.venv/bin/python
VARIANTS=${*:-"64,128,128,bf16,bounded,fp32,32 64,128,128,bf16,bounded,fp32,128 16,128,128,bf16,bounded,fp32,32 64,64,64,bf16,unbounded,bf16,32 64,128,128,fp16,precomputed,none,64 16,64,64,fp16,unbounded,fp32,16"}
mkdir -p "$OUT"
for spec in $VARIANTS; do
  IFS=, read -r C K V DT GATE ST BV <<<"$spec"
  NAME=$($PY - "$OUT" <<PYEOF
import sys, pathlib, jinja2
sys.path.insert(0, ".")
from kdagen.variant import Variant
v = Variant("sm80", $C, $K, $V, "$DT", "$GATE", "$ST", $BV)
env = jinja2.Environment(loader=jinja2.FileSystemLoader("templates"), undefined=jinja2.StrictUndefined,
                         trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
src = env.get_template("sm80/kda_fwd.cu.j2").render(variant=v, name=v.name)
d = pathlib.Path(sys.argv[1]) / v.name; d.mkdir(parents=True, exist_ok=True)
(d / "kernel.cu").write_text(src)
print(v.name)
PYEOF
)
  D="$OUT/$NAME"
  start=$(date +%s.%N)
  nvcc -O3 -std=c++17 --use_fast_math -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=sm_90 \
    -gencode=arch=compute_80,code=compute_80 -fatbin -Xptxas -v -Itemplates/common -Itemplates/sm80 \
    "$D/kernel.cu" -o "$D/$NAME.fatbin" 2> "$D/ptxas.log"
  end=$(date +%s.%N)
  printf "%-56s %5.1fs  " "$NAME" "$(echo "$end - $start" | bc)"
  $PY -c "import sys; sys.path.insert(0,'.'); from kdagen.build import parse_ptxas; print('  '.join(f\"{e['kernel']}/{e['arch']}: {e['registers']}r st{e['stack_bytes']} sp{e['spill_stores']}/{e['spill_loads']}\" for e in parse_ptxas(open('$D/ptxas.log').read())))"
done
