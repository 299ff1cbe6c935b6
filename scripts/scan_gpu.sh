#!/usr/bin/env bash
# Issues 17 and 19 on GPUs, in one call from the source tree (results under $OUT):
#   scripts/scan_gpu.sh            pytest -m gpu of the scan/cp tests, scripts/scan_bench.py (issue 17
#                                  rows, accuracy), and with 2+ GPUs scripts/cp_bench.py over NCCL
# Expected on one H200: tests ~1-2 min (Triton compiles the K=32 variants), bench ~2-4 min;
# cp_bench on 2 GPUs ~1-2 min. Nothing here has run on a GPU yet (written on a CPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdagen_scan}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KDAGEN_EAGER_FAILURES=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rc=0
python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider tests/test_scan_engine.py tests/test_cp.py \
  2>&1 | tee "$OUT/pytest_scan_gpu.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
python3 scripts/scan_bench.py --rows all --accuracy --out "$OUT/scan_h200.md" 2>&1 | tee "$OUT/scan_bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -ge 2 ]; then
  for p in 2 4; do
    [ "$n" -ge "$p" ] || continue
    torchrun --nproc_per_node "$p" scripts/cp_bench.py --out "$OUT/cp_h200x$p.md" 2>&1 | tee "$OUT/cp_bench_$p.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
else
  echo "cp_bench: $n GPU(s); issue 19's run needs 2 or more" | tee "$OUT/cp_bench.log"
fi
exit $rc
