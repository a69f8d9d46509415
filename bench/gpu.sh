#!/usr/bin/env bash
# Single-GPU checks of bench/gpu.py (see its docstring): the rewrite's overhead at world size 1
# and the shards' compute efficiency at N = 2, 4, 8. About 3-5 minutes on one recent GPU,
# mostly inductor compiling 5 graphs. Exits 0 with a message where no CUDA device is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "bench/gpu.sh: no CUDA device visible to torch; skipped"
  exit 0
fi
exec "$PY" bench/gpu.py "$@"
