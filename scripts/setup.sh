#!/usr/bin/env bash
# Install pptrace and what it needs on a fresh machine (Python >= 3.10).
#   bash scripts/setup.sh          the package (trainer, analysis, dashboards)
#   bash scripts/setup.sh --dev    plus the test tools and Debian's chromium for browser tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The CPU wheel of torch first: an unpinned `torch` pulls a multi-GB CUDA build. Skipped
# when a torch is already installed (users bring their own CUDA build).
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi

if [ "${1:-}" = "--dev" ]; then
    # The hta extra lets the tests cross-check GPU numbers against HTA (traceinsight, ~120 MB);
    # the megatron extra lets them run Megatron-Core's real schedules on gloo (a 2.6 MB wheel).
    "$PY" -m pip install -q -e '.[dev,hta,megatron]'
    if ! command -v chromium >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
    fi
else
    "$PY" -m pip install -q -e .
fi
