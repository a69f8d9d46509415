#!/usr/bin/env bash
# GPU checks, each a prepared script; all together sized for 8 minutes on one H100 (an
# estimate: 8 inductor compiles of 2 layers, the decode checks' compiles, an 8B step):
#   memory    python -m bench.gpu_memory: one rank's bf16 training step (AdamW) of a whole
#             Llama-3-8B-shaped Hugging Face model at TP 8 on a fake process group, built on
#             meta: parameters against the ideal, peak memory
#   overhead  python -m bench.gpu: numerics at world size 1, its overhead against the unsharded
#             model (bf16, eager and compiled), one rank's step at N = 2, 4, 8 on a fake
#             process group against parallelize_module (DTensor), eager and compiled
#   decode    python -m bench.gpu_decode: the decode step under torch.compile(mode=
#             "reduce-overhead") (CUDA graphs, all-reduces captured), tokens vs eager, per-token
#             latency; torchrun with one rank per GPU, at most 2
#   hf-decode python -m bench.gpu_hf_decode: at world size 1, a Hugging Face Llama's decode per
#             token: transformers' generate (dynamic cache; static cache compiled, its own
#             CUDA-graph path) against tpcompile's generate (eager; reduce-overhead)
# The one command on a lent GPU (from the repository root, after `pip install --no-deps -e .`):
#   timeout 480 bash bench/gpu.sh
# Rehearsal on CPU (the same code at tiny sizes, gloo; no GPU needed):
#   PYTHON=/path/to/venv/bin/python bash bench/gpu.sh all --device cpu
# Usage: bash bench/gpu.sh [all|memory|overhead|decode|hf-decode] [--device cpu | arguments for that one script]
# Exits 0 with a message where no CUDA device is visible (and no --device cpu); 2 on a usage error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
check="${1:-all}"
[ $# -gt 0 ] && shift
rehearsal=0
[ "$*" = "--device cpu" ] && rehearsal=1
case "$check" in
  memory|overhead|decode|hf-decode) ;;
  all) if [ $# -gt 0 ] && [ $rehearsal = 0 ]; then
         echo "bench/gpu.sh: arguments go with one check, or --device cpu" >&2
         exit 2
       fi ;;
  *) echo "usage: bash bench/gpu.sh [all|memory|overhead|decode|hf-decode] [--device cpu | arguments for that script]" >&2
     exit 2 ;;
esac
if [ $rehearsal = 1 ]; then  # tiny sizes, so that CPU compiles and steps take a few minutes
  overhead_args=(--device cpu --layers 1 --dim 64 --heads 4 --kv-heads 2 --hidden 128 --vocab 256
                 --seq 16 --steps 2 --warmup 1 --world-sizes 2)
  decode_args=(--device cpu --layers 1 --dim 64 --heads 4 --kv-heads 2 --vocab 256 --new 4)
  hf_decode_args=("${decode_args[@]}" --repeats 1)
  memory_args=(--device cpu --layers 2 --dim 64 --heads 4 --kv-heads 2 --hidden 128 --vocab 256
               --seq 16)
  ranks=2
else
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "bench/gpu.sh: no CUDA device visible to torch; skipped"
    exit 0
  fi
  overhead_args=("$@")
  decode_args=("$@")
  hf_decode_args=("$@")
  memory_args=("$@")
  ranks=$("$PY" -c "import torch; print(min(torch.cuda.device_count(), 2))")
fi
status=0  # a failed check does not stop the others; the exit status says one failed
if [ "$check" = memory ] || [ "$check" = all ]; then
  "$PY" -m bench.gpu_memory "${memory_args[@]}" || status=1
fi
if [ "$check" = overhead ] || [ "$check" = all ]; then
  "$PY" -m bench.gpu "${overhead_args[@]}" || status=1
fi
if [ "$check" = decode ] || [ "$check" = all ]; then
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ranks" -m bench.gpu_decode \
    "${decode_args[@]}" || status=1
fi
if [ "$check" = hf-decode ] || [ "$check" = all ]; then
  "$PY" -m bench.gpu_hf_decode "${hf_decode_args[@]}" || status=1
fi
exit $status
