#!/usr/bin/env bash
# The real-size bench (bench/scale.py) on a lent GPU machine: the 0.5B-shaped model with the learner, verifier
# and evaluator on the GPU and one torch client on the same GPU, sequential pull and async push-pull, batches a
# GPU learner would take (16 prompts × 4 samples × 128 tokens per step); then the same with the learner as FSDP over
# the one GPU in bf16 mixed precision (step time and duty for docs/benchmarks.md).
#
# That machine has torch and transformers but not all of our dependencies and no network. Prepare here, in the
# repository root (both folders are git-ignored through .git/info/exclude):
#   mkdir -p .whl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     "pydantic>=2.6,<3" pydantic-core annotated-types typing-inspection "typing-extensions>=4.16" \
#     "cryptography>=41" cffi pycparser "gguf>=0.19,<0.20" platformdirs
#   mkdir -p .gpu/cache/echo-swarm/models && cp -r ~/.cache/echo-swarm/models/tiny-qwen2-arith-* \
#     .gpu/cache/echo-swarm/models/      # the tokenizer the 0.5B model borrows (no build there)
# then run `bash bench/gpu_scale.sh` there with `.whl` and `.gpu` carried; results land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD XDG_CACHE_HOME=$PWD/.gpu/cache PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out/gpu}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 bench/scale.py --model qwen0.5b --device cuda --steps 8 --modes sequential,async --eval-every 0 \
  --prompts-per-step 16 --prompts-per-job 8 --group-size 4 --max-tokens 128 --checkpoint-every 4 \
  --timeout 200 --out "$OUT/scale" --plot "$OUT/scale_gpu.png" 2>&1 | tail -80
# the learner as FSDP2 over this one GPU (a group of one, NCCL) with bf16 mixed precision: bf16 compute, float32
# master weights, gradient reduction and Adam (issue 16; docs/operations.md §5). Same batches as above.
python3 bench/scale.py --model qwen0.5b --device cuda --steps 8 --modes sequential --eval-every 0 \
  --prompts-per-step 16 --prompts-per-job 8 --group-size 4 --max-tokens 128 --checkpoint-every 4 \
  --fsdp --mixed-precision bf16 --timeout 200 --out "$OUT/scale-fsdp-bf16" 2>&1 | tail -40
