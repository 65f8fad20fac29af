#!/usr/bin/env bash
# GPU checks for a machine with at least one CUDA device (never part of CI):
#   1. the recipe for a few steps under each launch config (single GPU, ZeRO-2, ZeRO-3), full and LoRA agents,
#      on a random-weight 0.5B-size model;
#   2. the actor-critic recipe (IAC with heads on the actors, MAAC with a Q critic) under ZeRO-2 and ZeRO-3;
#   3. the GPU benchmark (generation tokens/s, time per step).
# Usage: bash scripts/gpu_smoke.sh [output_dir]   (about 5 minutes on one H200)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-outputs/gpu-smoke}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
python=".venv/bin/python"
model_dir=$("$python" -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu, tempfile; print(gpu.build_model(tempfile.mkdtemp()))" | tail -n 1)
for config in single_gpu deepspeed_zero2 deepspeed_zero3; do
  for peft in false true; do
    echo "== $config, use_peft=$peft"
    .venv/bin/accelerate launch --config_file "recipes/accelerate/$config.yaml" --num_processes 1 recipes/magrpo.py \
      --model_name_or_path "$model_dir" --use_peft "$peft" --max_steps 3 --max_new_tokens 64 --bf16 true \
      --output_dir "$out/$config-peft-$peft" --eval_num_samples 2 --logging_steps 1 2>&1 | tail -n 8
  done
done
for config in deepspeed_zero2 deepspeed_zero3; do
  for options in "--algorithm iac --use_separate_critic false" "--algorithm maac --critic_type q"; do
    echo "== $config, actor-critic $options"
    # shellcheck disable=SC2086
    .venv/bin/accelerate launch --config_file "recipes/accelerate/$config.yaml" --num_processes 1 \
      recipes/actor_critic.py $options --model_name_or_path "$model_dir" --use_peft false --max_steps 3 \
      --max_new_tokens 64 --bf16 true --output_dir "$out/ac-$config-${options// /_}" --eval_num_samples 2 \
      --logging_steps 1 2>&1 | tail -n 8
  done
done
echo "== benchmark"
"$python" benchmarks/gpu.py --agents 2 --k 8 --tokens 128 | tee "$out/gpu-bench.txt"
"$python" benchmarks/gpu.py --agents 2 --k 8 --tokens 128 --lora | tee -a "$out/gpu-bench.txt"
