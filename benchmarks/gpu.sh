#!/usr/bin/env bash
# The CUDA/NCCL path in one run (under 8 minutes on a machine with 2+ GPUs): see benchmarks/gpu.py for what it
# measures. Writes benchmarks/results/gpu.json and gpu.md. `benchmarks/gpu.sh --dry-run` prints the commands only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--dry-run" ]; then
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible: nothing to measure (try --dry-run)')"
fi
exec timeout 470 python benchmarks/gpu.py "$@"
