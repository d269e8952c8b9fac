#!/usr/bin/env bash
# Installs the project's dependencies into the current Python environment.
# - A torch already installed in the supported range (2.11 to 2.13, CPU or CUDA) is kept.
# - Otherwise torch==2.13.0 is installed first: on the CPU machines this project is developed on
#   that wheel comes from local disk; an unpinned torch would pull gigabytes of CUDA packages.
set -euo pipefail
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
if ! "$PYTHON" - <<'PY' 2>/dev/null
import sys, torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= v < (2, 14) else 1)
PY
then
    echo "setup: installing torch==2.13.0"
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi
"$PYTHON" -m pip install -q -e ".[test]"
# torchao, the FP8 tests' oracle (tests/fp8_oracle_check.py), beside the environment and not in
# it: transformers imports an installed torchao with every model it builds
if [ ! -d .oracles/torchao ]; then
    "$PYTHON" -m pip install -q --no-deps --target .oracles "torchao==0.18.0"
fi
"$PYTHON" -c "import torch, transformers; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}')"
