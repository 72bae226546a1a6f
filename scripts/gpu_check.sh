#!/usr/bin/env bash
# GPU check, one script, no network, < 8 minutes on one H200:
#   1. the `gpu`-marked tests (tests needing Ray, aiohttp or SGLang skip when those are missing);
#   2. scripts/gpu_check.py: a randomly initialised ~0.5B Qwen2 (built from a config, no hub):
#      rollout tokens/s (TorchEngine on cuda), learner tokens/s and MFU (LearnerWorker, FSDP2 over
#      NCCL, world size 1), weight-sync seconds. No Ray, W&B or SGLang needed.
# Results: a table on stdout, JSON at $OUT/gpu_check.json (else benchmarks/results/gpu_check.json),
# the pytest log at $OUT/gpu_pytest.log when $OUT is set.
#
# Missing Python packages: if pydantic cannot be imported and wheels were carried in .whl/
# (pydantic, pydantic-core, annotated-types, typing-inspection), they are installed offline into a
# scratch directory on PYTHONPATH, never into the system site-packages.
#
# Launch from the repository root:  bash scripts/gpu_check.sh [extra gpu_check.py args]
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
LOGDIR="${OUT:-benchmarks/results}"
mkdir -p "$LOGDIR"

if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    DEPS="$(mktemp -d /tmp/gpu_check_deps.XXXXXX)"
    echo "[gpu_check.sh] pydantic missing: installing the wheels in .whl/ into $DEPS (offline)"
    PKGS="pydantic pydantic-core annotated-types typing-inspection"
    "$PY" -c "import typing_extensions" 2>/dev/null || PKGS="$PKGS typing-extensions"
    # by name from --find-links, so pip picks the pydantic-core wheel built for this Python
    "$PY" -m pip install --quiet --no-index --no-deps --find-links .whl --target "$DEPS" $PKGS \
      || echo "[gpu_check.sh] WARNING: offline wheel install failed"
    export PYTHONPATH="$PYTHONPATH:$DEPS"
  else
    echo "[gpu_check.sh] WARNING: pydantic is not importable and .whl/ holds no wheels; config-based phases will fail"
  fi
fi
"$PY" -c "import torch, transformers; print('[gpu_check.sh] torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"

echo "[gpu_check.sh] 1/2 pytest -m gpu"
t0=$(date +%s)
timeout "${PYTEST_TIMEOUT_S:-180}" "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests \
  > "$LOGDIR/gpu_pytest.log" 2>&1
rc_tests=$?
tail -n 25 "$LOGDIR/gpu_pytest.log"
[ "$rc_tests" -eq 5 ] && rc_tests=0  # 5: no test selected, not a failure
echo "[gpu_check.sh] pytest exit $rc_tests in $(( $(date +%s) - t0 )) s"

echo "[gpu_check.sh] 2/2 scripts/gpu_check.py $*"
t0=$(date +%s)
timeout "${CHECK_TIMEOUT_S:-360}" "$PY" scripts/gpu_check.py "$@"
rc_check=$?
echo "[gpu_check.sh] gpu_check.py exit $rc_check in $(( $(date +%s) - t0 )) s"

[ "$rc_tests" -eq 0 ] && [ "$rc_check" -eq 0 ]
