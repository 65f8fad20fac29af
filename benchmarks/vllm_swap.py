"""Cost of the one-engine layout: loading each agent's weights into the team's vLLM engine before it generates.

Two fully fine-tuned SmolLM2-135M-Instruct agents share one `TeamVLLM` engine (the layout vLLM supports on GPUs).
The agents generate in turn, so every call first loads the calling agent's weights (an in-place copy of the
model's tensors into the engine's, plus vLLM's weight processing). Reports the load time per call and per dtype.

    .venv-vllm/bin/python benchmarks/vllm_swap.py --dtypes float32,bfloat16 --calls 6
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--calls", type=int, default=6, help="generations, alternating between the two agents")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl_trl.generation import TeamVLLM
    from comlrl_trl.models.demo import demo_model_path

    torch.set_num_threads(args.threads)
    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    agents = [AutoModelForCausalLM.from_pretrained(path) for _ in range(2)]
    size = sum(p.numel() for p in agents[0].parameters())
    results = []
    for dtype in args.dtypes.split(","):
        team = TeamVLLM(agents, [tokenizer] * 2, max_completion_length=1, seed=0, dtype=dtype)
        loads = []
        for call in range(args.calls):
            before = team.load_seconds
            team.generate(call % 2, [[tokenizer.eos_token_id, 42, 43]])
            loads.append(team.load_seconds - before)
        team.close()
        result = dict(
            dtype=dtype,
            parameters=size,
            load_seconds=[round(x, 3) for x in loads],
            median_load_seconds=round(statistics.median(loads[1:]), 3),
        )
        print(json.dumps(result))
        results.append(result)
    settings = dict(vars(args), json=None, torch=torch.__version__, cpu=platform.processor() or platform.machine())
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": settings, "results": results, "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
