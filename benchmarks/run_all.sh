#!/usr/bin/env bash
# Regenerate every number and picture in docs/ on the built-in model (about 20 minutes, 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/builtin_report.py --out docs | tee docs/builtin_report.log
python benchmarks/compare_methods.py --out docs/bench | tee docs/bench/compare.log
python benchmarks/batch_scaling.py --images 16 | tee docs/batch_scaling.log
