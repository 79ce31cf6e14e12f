#!/usr/bin/env bash
# Here, once before a lent-GPU session: ../shared/gpu/prepare.sh's wheels into .whl/, then an openai client that runs on
# the GPU image's httpx. openai 3.x imports httpx2 (and httpcore2, truststore), which that image lacks: with the newest
# openai carried, tests/test_gpu.py's server test failed on `import openai` (2026-11-28, H200).
set -euo pipefail
bash "$(dirname "$0")/../../shared/gpu/prepare.sh"
rm -f .whl/openai-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl 'openai>=2.20,<3' \
  2>&1 | grep -v '^WARNING: Location' || true
ls .whl/openai-*.whl
