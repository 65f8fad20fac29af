"""The IAC and MAAC snippets of the "Training entities" page (spec 003), run against comlrl_trl.

Hub ids are replaced by local tiny models: Qwen2 for the Qwen2.5-Coder models, Llama where the page mixes two
sizes of actors with critics of their own. Settings that only make the run fast (`max_new_tokens`,
`output_dir`, no gradient checkpointing) are added to the page's configurations.
"""

from pathlib import Path

import torch
from datasets import Dataset
from helpers import changed, snapshot
from transformers import AutoTokenizer

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer


train_dataset = Dataset.from_dict({"prompt": [f"Write a function number {i}." for i in range(8)]})


def reward_func(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def _fast(tmp_dir):
    return dict(max_new_tokens=8, output_dir=str(tmp_dir), gradient_checkpointing=False, num_train_epochs=1)


def test_centralized_critic(qwen_path, tmp_path):
    trainer = MAACTrainer(
        agent_model=None,
        agents=[qwen_path, qwen_path],
        tokenizer=[
            AutoTokenizer.from_pretrained(qwen_path),
            AutoTokenizer.from_pretrained(qwen_path),
        ],
        critic_model=qwen_path,
        critics=None,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAACConfig(num_agents=2, num_turns=1, temperature=0.7, top_p=0.9, top_k=None, **_fast(tmp_path)),
    )
    assert len(trainer.critics) == 1  # the critic reads the joint text in its own tokenizer (Qwen's, as the agents')
    assert trainer.critic_set.tokenizer.get_vocab() == trainer.tokenizers[0].get_vocab()
    before = snapshot(trainer.critics[0])
    trainer.train()
    assert "value_head.net.0.weight" in changed(before, trainer.critics[0])


def test_separate_critics(qwen_path, llama_path, tmp_path):
    trainer = IACTrainer(
        agent_model=None,
        agents=[qwen_path, llama_path],
        tokenizer=[
            AutoTokenizer.from_pretrained(qwen_path),
            AutoTokenizer.from_pretrained(llama_path),
        ],
        critic_model=None,
        critics=[qwen_path, llama_path],
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=IACConfig(
            num_agents=2,
            num_turns=1,
            use_separate_critic=True,
            temperature=0.7,
            top_p=0.9,
            top_k=None,
            **_fast(tmp_path),
        ),
    )
    assert [type(c.model).__name__ for c in trainer.critics] == ["Qwen2ForCausalLM", "LlamaForCausalLM"]
    trainer.train()
    assert trainer.state.global_step == 1


def test_shared_backbone_critics(qwen_path, llama_path, tmp_path):
    trainer = IACTrainer(
        agent_model=None,
        agents=[qwen_path, llama_path],
        tokenizer=[
            AutoTokenizer.from_pretrained(qwen_path),
            AutoTokenizer.from_pretrained(llama_path),
        ],
        critic_model=None,
        critics=None,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=IACConfig(
            num_agents=2,
            num_turns=1,
            use_separate_critic=False,
            temperature=0.7,
            top_p=0.9,
            top_k=None,
            **_fast(tmp_path),
        ),
    )
    assert trainer.critics == [] and all(hasattr(model, "value_head") for model in trainer.agents)
    trainer.train()


def test_continue_maac_and_restore_the_value_head(qwen_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the page uses paths relative to the working directory
    first = MAACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAACConfig(num_agents=2, num_turns=1, **_fast(tmp_path)),
    )
    first.train()
    first.save_model("./saved-models/maac-run-1")

    saved_dir = Path("./saved-models/maac-run-1")
    actor_dirs = [str(saved_dir / f"agent_{i}") for i in range(2)]

    continued_maac = MAACTrainer(
        agents=actor_dirs,
        tokenizer=[AutoTokenizer.from_pretrained(path) for path in actor_dirs],
        critic_model=str(saved_dir / "critic"),
        reward_func=reward_func,
        train_dataset=train_dataset,
        args=MAACConfig(
            num_agents=2,
            num_turns=1,
            num_train_epochs=3,
            max_new_tokens=8,
            output_dir=str(tmp_path / "continued"),
            gradient_checkpointing=False,
        ),
    )
    continued_maac.critics[0].value_head.load_state_dict(
        torch.load(
            saved_dir / "critic" / "value_head.pt",
            map_location="cpu",
            weights_only=True,
        )
    )
    for saved, restored in zip(first.critics[0].parameters(), continued_maac.critics[0].parameters(), strict=True):
        assert torch.equal(saved, restored)  # backbone from the directory, head from value_head.pt
    continued_maac.train()
    continued_maac.save_model("./saved-models/maac-run-2")
    assert (tmp_path / "saved-models" / "maac-run-2" / "critic" / "value_head.pt").is_file()
    assert continued_maac.state.global_step == 3


def test_continue_iac_and_restore_heads(qwen_path, tmp_path):
    for separate in (False, True):
        critic = {"critic_model": qwen_path} if separate else {}
        first = IACTrainer(
            agent_model=qwen_path,
            reward_func=reward_func,
            train_dataset=train_dataset,
            args=IACConfig(
                use_separate_critic=separate,
                critic_value_head_hidden_dim=4,
                value_head_hidden_dim=4,
                **_fast(tmp_path / "first"),
            ),
            **critic,
        )
        first.train()
        saved_dir = tmp_path / f"iac-{separate}"
        first.save_model(str(saved_dir))
        actor_dirs = [str(saved_dir / f"agent_{i}") for i in range(2)]
        critic = {"critics": [str(saved_dir / f"agent_{i}" / "critic") for i in range(2)]} if separate else {}
        continued_iac = IACTrainer(
            agents=actor_dirs,
            tokenizer=[AutoTokenizer.from_pretrained(p) for p in actor_dirs],
            reward_func=reward_func,
            train_dataset=train_dataset,
            args=IACConfig(
                use_separate_critic=separate,
                critic_value_head_hidden_dim=4,
                value_head_hidden_dim=4,
                **_fast(tmp_path / "next"),
            ),
            **critic,
        )
        for i in range(2):
            if separate:
                head = continued_iac.critics[i].value_head
                path = saved_dir / f"agent_{i}" / "critic" / "value_head.pt"
                original = first.critics[i].value_head
            else:
                head = continued_iac.agents[i].value_head
                path = saved_dir / f"agent_{i}" / "value_head.pt"
                original = first.agents[i].value_head
            head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            assert all(torch.equal(p, q) for p, q in zip(head.parameters(), original.parameters(), strict=True))
        continued_iac.train()
