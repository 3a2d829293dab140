#!/usr/bin/env bash
# Run benchmarks/accelerator.py on a GPU host whose Python has jax[cuda], flax, optax, orbax, tokenizers
# and transformers but not the packages the end-to-end step needs (the task loader's grain, the config's
# ml-collections, the math grader).
#
#   benchmarks/accelerator_device.sh prepare   # on a machine with PyPI: wheels into .whl/ (git-ignored)
#   benchmarks/accelerator_device.sh           # on the GPU host, from the repository root, with .whl/ beside it
#
# Results: JSON lines on stdout and in ${OUT:-/tmp}/accelerator.jsonl. Each part has its own limit (9.3
# minutes in all; decode first: the figures most wanted).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "prepare" ]]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d .whl \
    ml-collections==1.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
    grain==0.2.18 array-record==0.8.6 portpicker==1.6.0
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
python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
# One process per part, each under its own limit, so that one part's failure or hang keeps the others' figures.
rc=0
# The end-to-end part at 256 new tokens here (8 tasks); at the preset's 5,120 it needs a call of its own:
#   python3 benchmarks/accelerator.py --parts=e2e --e2e_tasks=1   (about 5 minutes on one GPU, untried)
for part in "decode:250" "update:100" "e2e:150" "attention:60"; do
  extra=()
  [[ "${part%%:*}" == e2e ]] && extra=(--e2e_tasks=8 --e2e_new_tokens=256)
  timeout "${part##*:}" python3 benchmarks/accelerator.py --out="$OUTFILE" --parts="${part%%:*}" ${extra[@]+"${extra[@]}"} "$@" || rc=$?
done
exit $rc
