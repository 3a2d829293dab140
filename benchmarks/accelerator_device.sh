#!/usr/bin/env bash
# Run benchmarks/accelerator.py on a GPU host whose Python has jax[cuda], flax, optax, orbax, tokenizers
# and transformers but not the pure-Python packages the end-to-end step needs.
#
#   benchmarks/accelerator_device.sh prepare   # on a machine with PyPI: wheels into .whl/ (git-ignored)
#   benchmarks/accelerator_device.sh           # on the GPU host, from the repository root, with .whl/ beside it
#
# Results: JSON lines on stdout and in ${OUT:-/tmp}/accelerator.jsonl. Sized to finish within 8 minutes
# on one H200, compilation included.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "prepare" ]]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform any -d .whl \
    ml-collections==1.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  exit 0
fi

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  echo "no .whl/: the end-to-end part will report itself skipped" >&2
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=.9
OUTFILE="${OUT:-/tmp}/accelerator.jsonl"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 540 python3 benchmarks/accelerator.py --out="$OUTFILE" "$@"
