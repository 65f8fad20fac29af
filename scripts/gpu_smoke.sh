#!/usr/bin/env bash
# GPU checks for a machine with a CUDA device (never part of CI), in parts that each take under 8 minutes on one
# H200. Every part first asserts that torch sees CUDA.
#
# Needs `make install-demo` with a CUDA build of torch (README, "GPU install"), and deepspeed for the ZeRO parts.
#
# Usage: bash scripts/gpu_smoke.sh PART [output_dir]
#   single      the recipe on one GPU (full and LoRA agents), bf16 autocast over fp32 master weights, and the GPU
#               benchmark (generation tokens/s over generation time, labelled full/LoRA, weights dtype, launcher)
#   zero2       MAGRPO (full, LoRA), IAC with heads on the actors and MAAC with a Q critic, under ZeRO-2
#   zero3       the same under ZeRO-3
#   preference  MARLHF, iterative MARLHF (engines rebuilt, memory flat), MADPO, under ZeRO-2 and ZeRO-3; a ZeRO-3
#               value head with a hidden layer saved and restored (tiny models, the tests' scripts)
#   resume      a run killed after its first epoch's checkpoint, then resumed (single GPU); resume under ZeRO-2/3
#               (MAGRPO, MAAC's critic, IAC's heads) giving exactly the uninterrupted run's weights
#   vllm        the benchmark with use_vllm=True (colocate): full agents (one engine each), LoRA agents (one
#               engine), and one agent (the step time of a plain single-policy GRPO run on the same engine); needs
#               vLLM in the venv (pip install 'comlrl-trl[vllm]' with the CUDA torch)
#   all         every part in turn (about 20-25 minutes)
# Not covered: DDP with several processes needs one GPU per process (NCCL refuses two ranks on one device); the
# 2-process runs are tested on the CPU with gloo (tests/test_distributed.py).
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:?usage: bash scripts/gpu_smoke.sh single|zero2|zero3|preference|resume|vllm|all [output_dir]}"
out="${2:-outputs/gpu-smoke}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH="$PWD"
python=".venv/bin/python"

"$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else
  f'CUDA is not available to torch {torch.__version__} (CUDA build: {torch.version.cuda}): install a CUDA build')"

model() {  # a random-weight 0.5B-size model, built once per output directory
  if [ ! -f "$out/model/config.json" ]; then
    "$python" -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu; gpu.build_model('$out/model')" >/dev/null
  fi
  echo "$out/model"
}

recipe() {  # recipe() CONFIG SCRIPT NAME ARGS...: a 3-step recipe run under recipes/accelerate/CONFIG.yaml
  local config="$1" script="$2" name="$3"
  shift 3
  echo "== $name ($config)"
  .venv/bin/accelerate launch --config_file "recipes/accelerate/$config.yaml" --num_processes 1 "recipes/$script" \
    --model_name_or_path "$(model)" --max_steps 3 --max_new_tokens 64 --bf16 true --dtype float32 \
    --output_dir "$out/$config-$name" --eval_num_samples 2 --logging_steps 1 "$@" 2>&1 | tail -n 8
}

zero() {  # zero() CONFIG: the team and actor-critic recipes under one DeepSpeed config
  recipe "$1" magrpo.py magrpo-full --use_peft false
  recipe "$1" magrpo.py magrpo-lora --use_peft true
  recipe "$1" actor_critic.py iac-heads --algorithm iac --use_separate_critic false --use_peft false
  recipe "$1" actor_critic.py maac-q --algorithm maac --critic_type q --use_peft false
}

torchrun_script() {  # torchrun_script STAGE SCRIPT ARGS...: a tests/scripts check in one process under ZeRO-STAGE
  local stage="$1" script="$2"
  shift 2
  echo "== $script $* (ZeRO-$stage)"
  ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE="$stage" "$python" -m torch.distributed.run \
    --standalone --nproc_per_node 1 "tests/scripts/$script" "$out/$script-$stage-${1:-run}" "$@" 2>&1 \
    | grep -E "^RESULT|Error" | tail -n 3
}

single() {
  recipe single_gpu magrpo.py full --use_peft false
  recipe single_gpu magrpo.py lora --use_peft true
  echo "== benchmark"
  "$python" benchmarks/gpu.py --agents 2 --k 8 --tokens 128 | tee "$out/gpu-bench.txt"
  "$python" benchmarks/gpu.py --agents 2 --k 8 --tokens 128 --lora | tee -a "$out/gpu-bench.txt"
}

preference() {
  for stage in 2 3; do
    torchrun_script "$stage" marlhf_deepspeed.py
    torchrun_script "$stage" marlhf_deepspeed.py iter
    torchrun_script "$stage" madpo_ties.py
  done
  torchrun_script 3 value_head_zero3.py
}

resume() {
  echo "== resume (killed before epoch 2, then resumed)"
  rm -rf "$out/resume"
  "$python" tests/scripts/checkpoint_run.py "$out/resume" "$out/resume-killed.json" --kill-before-epoch 2 || true
  "$python" tests/scripts/checkpoint_run.py "$out/resume" "$out/resume.json" --resume
  "$python" -c "import json; r = json.load(open('$out/resume.json')); assert len(r['rewards']) > 0; print('RESULT', r)"
  for run in "2 magrpo" "3 magrpo" "2 maac" "3 iac"; do  # under DeepSpeed: resumed == uninterrupted, exactly
    set -- $run
    echo "== resume under ZeRO-$1 ($2)"
    rm -rf "$out/ds-resume-$1-$2"
    for mode in full resume; do
      ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE="$1" "$python" -m torch.distributed.run \
        --standalone --nproc_per_node 1 tests/scripts/deepspeed_resume.py "$out/ds-resume-$1-$2" "$mode" "$2" \
        2>&1 | grep "^RESULT" > "$out/ds-resume-$1-$2-$mode.txt"
    done
    cmp <(cut -d' ' -f2- "$out/ds-resume-$1-$2-full.txt") <(cut -d' ' -f2- "$out/ds-resume-$1-$2-resume.txt") \
      && echo "same weights"
  done
}

vllm_part() {
  "$python" -c "import vllm" || { echo "vLLM is not installed in $python's venv" >&2; exit 1; }
  for flags in "--agents 2" "--agents 2 --lora" "--agents 1"; do
    echo "== benchmark, vLLM colocate, $flags"
    "$python" benchmarks/gpu.py --vllm --k 8 --tokens 128 $flags | tee -a "$out/gpu-bench-vllm.txt"
  done
}

case "$part" in
  single) single ;;
  zero2) zero deepspeed_zero2 ;;
  zero3) zero deepspeed_zero3 ;;
  preference) preference ;;
  resume) resume ;;
  vllm) vllm_part ;;
  all) single; zero deepspeed_zero2; zero deepspeed_zero3; preference; resume; vllm_part ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
