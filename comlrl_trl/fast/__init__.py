"""CPU speed-ups of generation: a lean decoding loop for Llama and Qwen2 models (`decoding`), one loop for a whole
team's rows (`joint_decoding`), top-k and top-p from one top-k (`top_k_top_p`), a multinomial draw over the tokens
top-k kept (`multinomial`), packed linear weights (`packed_linear`) and fewer fixed costs per call
(`call_overheads`). Each keeps the tokens and random state of the stock path it stands in for (packed fp16 weights
excepted, see `packed_linear`). The rollout path reaches them only through `comlrl_trl.generation`'s generators.
"""
