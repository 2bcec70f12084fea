#!/usr/bin/env bash
# Regenerate every number and picture in docs/ on the built-in model (about 75 minutes on
# 2 CPU cores). Each step writes its log beside its outputs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p docs/bench docs/bench-rows docs/bench-bf16 docs/drafting docs/drafting-long
python benchmarks/builtin_report.py --out docs --sweep | tee docs/builtin_report.log
python benchmarks/compare_methods.py --out docs/bench | tee docs/bench/compare.log
python benchmarks/drafting.py --prompts 8 --seeds 2 --rules sjd,csd:delta=0.65 \
    --couplings none,maximal,gumbel --inits uniform,vertical --windows 16 \
    --out docs/drafting | tee docs/drafting/drafting.log
python benchmarks/drafting.py --prompts 8 --seeds 2 \
    --rules sjd,csd:delta=0.35,csd:delta=0.65,csd:delta=0.8 --couplings maximal \
    --inits vertical --windows 32,64 --out docs/drafting-long | tee docs/drafting-long/drafting.log
python benchmarks/window_prior.py | tee docs/window_prior.log
python benchmarks/gpu_latency.py --device cpu --batches 1 --windows 16,32,auto --groups 16 \
    | tee docs/latency_cpu.log
python benchmarks/gpu_latency.py --device cpu --batches 8 --windows 16,32,auto --groups 4 \
    | tee docs/latency_cpu_b8.log
python benchmarks/gpu_latency.py --device cpu --dtype bfloat16 --batches 1,8 --windows 16,auto \
    --groups 4 | tee docs/latency_cpu_bf16.log
speculaas bench --dtype bfloat16 --methods ar,sjd,csd:delta=0.65 --seeds 2 --out docs/bench-bf16 \
    | tee docs/bench-bf16/bench.log
python benchmarks/batch_scaling.py --images 16 | tee docs/batch_scaling.log
python benchmarks/rows.py --out docs/bench-rows | tee docs/bench-rows/rows.log
python benchmarks/rows_picture.py --out docs/rows_map.png
