"""CPU speed-ups of generation: our own decoding loop for Llama and Qwen2 models (`decoding`), one loop for a whole
team's rows (`joint_decoding`), top-k and top-p from one top-k (`top_k_top_p`), a multinomial draw over the tokens
top-k kept (`multinomial`) and packed linear weights (`packed_linear`), all called as functions by the loop: nothing
of torch, transformers, Accelerate or TRL is replaced. Each keeps the tokens and random state of transformers'
`generate` (packed fp16 weights excepted, see `packed_linear`). The rollout path reaches them only through
`comlrl_trl.generation`'s generators.

One speed-up of training sits here too, off unless asked for because it changes process-wide state: freed memory
kept in the process for reuse (`memory`, `TeamConfig.keep_freed_cpu_memory`).
"""
