#!/usr/bin/env bash
# Here, once before a lent-GPU session: ../shared/gpu/prepare.sh's wheels into .whl/, then what the newest of them import
# beyond that image (2026-11-28, H200; tests/test_gpu.py's server test failed on each import): an openai client that
# runs on the image's httpx (openai 3.x imports httpx2, httpcore2 and truststore), and opentelemetry-api (fastapi
# 0.165 imports it).
set -euo pipefail
bash "$(dirname "$0")/../../shared/gpu/prepare.sh"
rm -f .whl/openai-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl 'openai>=2.20,<3' \
  2>&1 | grep -v '^WARNING: Location' || true
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl 'opentelemetry-api' \
  2>&1 | grep -v '^WARNING: Location' || true
ls .whl/openai-*.whl .whl/opentelemetry_api-*.whl
