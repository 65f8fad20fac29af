"""The team's arguments are declared once (`TeamKwargs`), and every agent tokenises with its own tokenizer.

Every family's `__init__` takes the shared keywords as `**team_kwargs` and declares only its own; its public
signature is still the full one, in the documented order, and a misspelt keyword is a TypeError naming it.
"""

import inspect

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from comlrl_trl.trainers.actor_critic import IACTrainer, MAACTrainer
from comlrl_trl.trainers.actor_critic.ac_trainer import ActorCriticTrainer
from comlrl_trl.trainers.preference import MADPOTrainer, MARLHFTrainer
from comlrl_trl.trainers.preference.rl_stage import build_stage_trainer
from comlrl_trl.trainers.reinforce import MAGRPOTrainer, MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer
from comlrl_trl.trainers.reinforce.centralized_magrpo import CentralizedMAGRPOTrainer
from comlrl_trl.trainers.team.inputs import TEAM_KEYWORDS, team_init
from comlrl_trl.trainers.team.trainer import TeamTrainer


FAMILIES = [
    TeamTrainer,
    MAGRPOTrainer,
    MAREINFORCETrainer,
    MARLOOTrainer,
    MAReMaxTrainer,
    CentralizedMAGRPOTrainer,
    IACTrainer,
    MAACTrainer,
    MADPOTrainer,
    MARLHFTrainer,
]

# The documented order (docs/reinforce.md, MAGRPOTrainer's docstring): every family shares it after agent_model.
DOCUMENTED = (
    "agents",
    "num_agents",
    "tokenizer",
    "formatters",
    "reward_func",
    "reward_processor",
    "train_dataset",
    "eval_dataset",
    "args",
    "external_transition",
    "wandb_config",
    "eval_logger",
    "eval_aggregator",
    "metrics_callback",
    "peft_config",
    "callbacks",
)


def _team_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _team_subclasses(sub)


def test_the_shared_keywords_are_declared_once_in_the_documented_order():
    assert TEAM_KEYWORDS == DOCUMENTED
    library = [cls for cls in _team_subclasses(TeamTrainer) if cls.__module__.startswith("comlrl_trl.")]
    for cls in {*FAMILIES, *library}:
        own = inspect.signature(inspect.unwrap(cls.__init__)).parameters  # what the family itself declares
        assert not set(own) & set(TEAM_KEYWORDS), f"{cls.__name__} redeclares {sorted(set(own) & set(TEAM_KEYWORDS))}"
        assert any(p.kind is p.VAR_KEYWORD for p in own.values()), cls.__name__
    stage_own = inspect.signature(build_stage_trainer).parameters
    assert not set(stage_own) & set(TEAM_KEYWORDS)


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda cls: cls.__name__)
def test_every_family_shows_the_full_signature(cls):
    params = list(inspect.signature(cls).parameters.values())
    assert params[0].name == "agent_model"
    # CoMLRL's IAC/MAAC take no num_agents (args.num_agents counts the agents); everything else takes them all
    expected = tuple(name for name in TEAM_KEYWORDS if name != "num_agents" or not issubclass(cls, ActorCriticTrainer))
    shared = params[1 : 1 + len(expected)]
    assert tuple(p.name for p in shared) == expected
    assert all(p.kind is p.KEYWORD_ONLY and p.default is None for p in shared)
    if cls is CentralizedMAGRPOTrainer:  # CoMLRL's: every argument keyword-only, ending in **kwargs
        assert params[0].kind is params[0].KEYWORD_ONLY and params[-1].kind is params[-1].VAR_KEYWORD
    else:
        assert params[0].kind is params[0].POSITIONAL_OR_KEYWORD
        assert not [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_each_family_keeps_its_own_keywords_after_the_shared_ones():
    def own(cls):
        names = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY]
        return [name for name in names if name not in TEAM_KEYWORDS and name != "agent_model"]

    assert own(MAGRPOTrainer) == own(MADPOTrainer) == []
    assert own(IACTrainer) == own(MAACTrainer) == ["critic_model", "critics", "critic_peft_config", "model_config"]
    assert own(MARLHFTrainer) == [*own(IACTrainer), "reward_peft_config", "joint_formatter"]
    assert own(CentralizedMAGRPOTrainer) == ["centralized_adapter"]


@pytest.mark.parametrize("cls", FAMILIES, ids=lambda cls: cls.__name__)
def test_a_misspelt_keyword_is_a_type_error_naming_it_before_any_loading(cls):
    # "no/such/model" is never looked at: the keyword check comes first
    with pytest.raises(
        TypeError,
        match=rf"^{cls.__name__}\.__init__\(\) got an unexpected keyword argument 'rewad_func'; did you mean 'reward_func'\?$",
    ):
        cls(agent_model="no/such/model", rewad_func=len)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'colour'; it takes agents, (num_agents, )?tok"):
        cls(agent_model="no/such/model", colour="blue")


def test_a_misspelt_own_keyword_is_named_too_and_a_second_positional_argument_is_refused():
    with pytest.raises(TypeError, match=r"'critic_modl'; did you mean 'critic_model'\?"):
        MAACTrainer("no/such/model", critic_modl="x")
    with pytest.raises(TypeError, match=r"'joint_formater'; did you mean 'joint_formatter'\?"):
        MARLHFTrainer("no/such/model", joint_formater=str)
    with pytest.raises(TypeError, match=r"'num_agents'; did you mean 'agents'\?"):  # args.num_agents counts them
        IACTrainer("no/such/model", num_agents=2)
    with pytest.raises(TypeError, match="positional argument"):
        MAGRPOTrainer("no/such/model", ["a", "b"])


def test_team_init_refuses_an_init_that_redeclares_a_shared_keyword():
    def redeclaring(self, agent_model=None, *, reward_func=None, **team_kwargs):
        pass

    with pytest.raises(TypeError, match=r"redeclares the shared keywords \['reward_func'\]"):
        team_init(redeclaring)
    with pytest.raises(TypeError, match=r"must take the shared keywords as \*\*team_kwargs"):
        team_init(lambda self, agent_model=None: None)


def test_every_agent_tokenises_its_prompts_and_completions_with_its_own_tokenizer(qwen_path, llama_path, make_config):
    """A Qwen agent and a Llama agent (different vocabularies) with different prompts: each agent's scored batch
    holds its own prompt in its own tokenizer's ids, and its completions decode (with its tokenizer) to the texts
    the joint reward received for it. The team trainer itself has no tokenizer."""
    tokenizers = [AutoTokenizer.from_pretrained(p, padding_side="left") for p in (qwen_path, llama_path)]
    assert tokenizers[0].vocab_size != tokenizers[1].vocab_size
    items = Dataset.from_dict({"topic": ["cats", "dogs"]})
    formatters = [
        lambda item: f"Qwen writes about {item['topic']}:",
        lambda item: f"Llama answers on {item['topic']}:",
    ]
    rewarded = [[], []]

    def reward(a, b):
        rewarded[0].extend(a)
        rewarded[1].extend(b)
        return [float(len(x) - len(y)) for x, y in zip(a, b)]

    trainer = MAGRPOTrainer(
        agents=[qwen_path, llama_path],
        tokenizer=tokenizers,
        formatters=formatters,
        reward_func=reward,
        train_dataset=items,
        args=make_config(num_generations=2, per_device_train_batch_size=2, max_new_tokens=4, max_steps=1),
    )
    assert trainer.processing_class is None  # no agent hosts the team's tokenizer
    assert trainer.tokenizers == tokenizers
    scored = [[], []]
    for index, agent in enumerate(trainer.agent_trainers):
        fill = agent.fill_micro_batches

        def recording_fill(batch, advantages, fill=fill, index=index):
            scored[index].append(batch)
            return fill(batch, advantages)

        agent.fill_micro_batches = recording_fill
    trainer.train()
    for index, (tokenizer, formatter) in enumerate(zip(tokenizers, formatters)):
        batch = scored[index][0]
        prompts = [
            tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])
        ]
        assert prompts == [formatter({"topic": "cats"})] * 2
        other = tokenizers[1 - index]  # the other agent's tokenizer reads these ids as some other text
        assert (
            other.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()], skip_special_tokens=True)
            != prompts[0]
        )
        completions = [
            tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(batch["completion_ids"], batch["completion_mask"])
        ]
        assert completions == rewarded[index][: len(completions)]
