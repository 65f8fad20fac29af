"""GPU variant of the benchmark: generation tokens/s (over generation time only) and time per step on a
random-weight 0.5B-size model, fp32 weights with bf16 autocast.

    python benchmarks/gpu.py [--agents 2] [--k 8] [--tokens 128] [--items 16] [--lora]

Builds a Llama-style model with Qwen2.5-0.5B's layer sizes and the SmolLM2 tokenizer (random weights; nothing is
downloaded), then trains a team of agents for one epoch on one GPU and prints one JSON line with the numbers,
labelled with what ran: full or LoRA training, the weights' dtype, the autocast precision and the launcher.
Run it under each launch config with `scripts/gpu_smoke.sh`. It needs a CUDA device.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(directory: str) -> str:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from comlrl_trl.models.demo import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--items-per-step", type=int, default=2)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="generate with the team's vLLM engines (colocate)")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device; use benchmarks/bench.py on the CPU.")
    model_dir = build_model(tempfile.mkdtemp(prefix="comlrl-gpu-model-"))
    config = MAGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        num_agents=args.agents,
        num_generations=args.k,
        max_new_tokens=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},
        per_device_train_batch_size=args.k * args.items_per_step,
        learning_rate=1e-6,
        bf16=True,
        num_train_epochs=1,
        logging_steps=10**9,
        eval_interval=0,
        report_to="none",
        gradient_checkpointing=True,
        disable_tqdm=True,
        use_vllm=args.vllm,
        # The model directory holds bf16 weights (half the disk): train on fp32 master weights under bf16 autocast,
        # as the recipes do (--dtype float32); without a dtype they would load, and train, in bf16.
        model_init_kwargs={"dtype": "float32"},
        vllm_gpu_memory_utilization=0.8,  # one engine per process, whatever the agents (comlrl_trl.generation)
    )
    steps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *unused, **kwargs):
            steps.append(time.perf_counter())

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM") if args.lora else None
    dataset = Dataset.from_dict(
        {"prompt": [f"Task {i}: write a paragraph about topic {i}." for i in range(args.items)]}
    )
    trainer = MAGRPOTrainer(
        agent_model=model_dir,
        num_agents=args.agents,
        train_dataset=dataset,
        args=config,
        reward_func=lambda *lists: [float(sum(map(len, joint)) % 7) for joint in zip(*lists)],
        peft_config=lora,
        callbacks=[Clock()],
    )
    generation = {"seconds": 0.0, "tokens": 0}
    for agent in trainer.agent_trainers:
        agent.generate = _timed_generate(agent.generate, generation, torch)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    steady = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else total
    accelerator = trainer.accelerator
    launcher = str(accelerator.distributed_type).split(".")[-1]
    if accelerator.state.deepspeed_plugin is not None:
        launcher += f" ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    print(
        "RESULT "
        + json.dumps(
            {
                "gpu": torch.cuda.get_device_name(),
                "agents": args.agents,
                "k": args.k,
                "tokens": args.tokens,
                "training": "lora" if args.lora else "full",
                "generation": "vllm" if args.vllm else "transformers",
                # what actually ran: the weights' storage dtype and the autocast precision (bf16 over fp32 weights is
                # mixed precision, not a bf16 model)
                "weights_dtype": str(next(trainer.agents[0].parameters()).dtype).replace("torch.", ""),
                "mixed_precision": "bf16" if config.bf16 else ("fp16" if config.fp16 else "no"),
                "launcher": f"{launcher}, {accelerator.num_processes} process(es)",
                "seconds": total,
                "seconds_per_step": steady,
                "generation_seconds": generation["seconds"],
                "generated_tokens": generation["tokens"],
                "generated_tokens_per_s": generation["tokens"] / generation["seconds"]
                if generation["seconds"]
                else None,
                "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
    )


def _timed_generate(generate, totals: dict, torch):
    """Wrap an agent's `generate`: add its wall time (CUDA synchronised) and its completion tokens to `totals`."""

    def timed(prompts):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rollout = generate(prompts)
        torch.cuda.synchronize()
        totals["seconds"] += time.perf_counter() - start
        totals["tokens"] += sum(len(ids) for ids in rollout.completion_ids)
        return rollout

    return timed


if __name__ == "__main__":
    main()
