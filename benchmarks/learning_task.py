"""The seed tutorial's task and one evaluation protocol, shared by comlrl_trl's and the peer's learning runs.

Imports nothing from either package (the peer's worker runs in its own virtual environment), only torch and
transformers. The protocol scores a team on fixed prompts with fixed sampling settings, whatever each package
samples at during training, so that rewards are comparable across packages:

- the prompts as plain text (no chat template; with `--chat`, the chat template's text of one user message, as in
  training), `max_new_tokens` new tokens;
- `samples` completions per prompt at temperature 1.0 (no top-p or top-k) from a fixed seed, and one greedy
  completion;
- the tutorial's length-ratio reward of each joint completion (agent 0's and agent 1's i-th completions);
- the score is the mean of the sampled mean and the greedy mean.

Reported beside the score, not in it: `sampled_as_trained`, the same samples drawn with the tutorial's training
sampling settings (temperature 0.6, top-p 0.6, top-k 50, both packages' defaults), the distribution a run trains.
"""

import math

import torch


#: The tutorial's ten training prompts (CoMLRL documentation, "长度比训练").
TRAIN_PROMPTS = [
    "Describe a city in the clouds:",
    "Invent a new holiday and explain it:",
    "Write a bedtime story for a dragon:",
    "Explain how teleportation might work:",
    "Tell a joke about dinosaurs:",
    "Describe a world without electricity:",
    "Create a superhero with a unique power:",
    "Write a scene where the moon talks:",
    "Invent a new type of fruit:",
    "Design a playground on Mars:",
]

#: Ten prompts of the same kind that no run trains on.
HELD_OUT_PROMPTS = [
    "Describe a forest that grows underwater:",
    "Invent a new board game and explain the rules:",
    "Write a lullaby for a robot:",
    "Explain how a time machine might work:",
    "Tell a joke about penguins:",
    "Describe a world without music:",
    "Create a villain who is afraid of the dark:",
    "Write a scene where the sun gets tired:",
    "Invent a new kind of vehicle:",
    "Design a school on the moon:",
]


def as_chat_text(tokenizer, prompts):
    """`prompts` as the text of one user message each under the tokenizer's chat template, ready for the assistant's
    answer (both packages then tokenize the same text; `learning.py --chat`)."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def length_ratio_reward(completions1, completions2, target_min=2.0, target_max=3.0):
    """The tutorial's reward: 1 when len(second) / len(first) is in [target_min, target_max], else exp(-distance)."""
    rewards = []
    for c1, c2 in zip(completions1, completions2):
        if len(c1) == 0:
            rewards.append(0.0)
            continue
        ratio = len(c2) / len(c1)
        distance = max(target_min - ratio, ratio - target_max, 0.0)
        rewards.append(float(math.exp(-distance)))
    return rewards


#: Sampling of the protocol's `sampled` half: the model's own distribution.
UNTEMPERED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
#: The tutorial's training sampling (both packages' defaults), for `sampled_as_trained`.
AS_TRAINED = {"temperature": 0.6, "top_p": 0.6, "top_k": 50}


@torch.no_grad()
def _complete(model, tokenizer, prompts, max_new_tokens, samples, seed, sampling=UNTEMPERED):
    """`samples` completions per prompt with `sampling` (0: one greedy completion), decoded without special
    tokens."""
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    if samples:
        kwargs.update(do_sample=True, **sampling, num_return_sequences=samples)
        torch.manual_seed(seed)
    else:
        kwargs.update(do_sample=False)
    out = model.generate(**batch, **kwargs)
    if was_training:
        model.train()
    new = out[:, batch["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return texts, completion_shape(new.tolist(), texts, tokenizer)


def completion_shape(rows, texts, tokenizer) -> dict:
    """What the reward does not show: mean characters, tokens up to the first EOS (the stopping token) and special
    tokens before it (a pad token the model chose to emit: dropped from the text, so it shortens a completion
    without ending it)."""
    stop = tokenizer.eos_token_id
    special = set(tokenizer.all_special_ids)
    lengths, inside = [], []
    for row in rows:
        length = row.index(stop) if stop in row else len(row)
        lengths.append(length)
        inside.append(sum(token in special for token in row[:length]))
    count = max(len(rows), 1)
    return {
        "chars": sum(len(text) for text in texts) / count,
        "tokens": sum(lengths) / count,
        "special_tokens": sum(inside) / count,
    }


def evaluate_team(models, tokenizers, prompts, max_new_tokens=48, samples=4, seed=1234) -> dict:
    """The protocol above for a team of two; returns the sampled, greedy and combined mean rewards, and the
    sampled one at the training settings."""
    if len(models) != 2:
        raise ValueError(f"the length-ratio task has two agents, got {len(models)} models")
    result = {"shape": {}}
    for name, count, sampling in (
        ("sampled", samples, UNTEMPERED),
        ("greedy", 0, UNTEMPERED),
        ("sampled_as_trained", samples, AS_TRAINED),
    ):
        outputs = [
            _complete(model, tokenizer, prompts, max_new_tokens, count, seed + agent, sampling)
            for agent, (model, tokenizer) in enumerate(zip(models, tokenizers))
        ]
        rewards = length_ratio_reward(*(texts for texts, _ in outputs))
        result[name] = sum(rewards) / len(rewards)
        result["shape"][name] = [shape for _, shape in outputs]
    result["reward"] = (result["sampled"] + result["greedy"]) / 2
    return result
