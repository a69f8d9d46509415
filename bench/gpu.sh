#!/usr/bin/env bash
# GPU checks, each a prepared script that fits a 10-minute budget on one recent GPU:
#   overhead  bench/gpu.py: the rewrite's overhead at world size 1 and the shards' compute
#             efficiency at N = 2, 4, 8 (3-5 minutes, mostly inductor compiling 5 graphs)
#   decode    bench/gpu_decode.py: the decode step under torch.compile(mode="reduce-overhead")
#             (CUDA graphs, all-reduces captured), tokens vs eager, per-token latency; torchrun
#             with one rank per GPU, at most 2 (about 2 minutes)
# Usage: bash bench/gpu.sh [all|overhead|decode] [arguments for that one script]
# Exits 0 with a message where no CUDA device is visible; 2 on a usage error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
check="${1:-all}"
[ $# -gt 0 ] && shift
case "$check" in
  overhead|decode) ;;
  all) if [ $# -gt 0 ]; then echo "bench/gpu.sh: arguments go with one check: overhead or decode" >&2; exit 2; fi ;;
  *) echo "usage: bash bench/gpu.sh [all|overhead|decode] [arguments for that script]" >&2; exit 2 ;;
esac
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "bench/gpu.sh: no CUDA device visible to torch; skipped"
  exit 0
fi
if [ "$check" = overhead ] || [ "$check" = all ]; then
  "$PY" -m bench.gpu "$@"
fi
if [ "$check" = decode ] || [ "$check" = all ]; then
  ranks=$("$PY" -c "import torch; print(min(torch.cuda.device_count(), 2))")
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ranks" -m bench.gpu_decode "$@"
fi
