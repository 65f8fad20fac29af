"""Cross mode's returns, worked out by hand: every agent's completion gets the mean reward of the joint actions
it takes part in."""

from datasets import Dataset

from comlrl_trl.trainers.reinforce import MAGRPOTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def test_cross_mode_gives_every_agent_its_own_completion_returns(qwen_path, make_config):
    """K=2, N=2, cross: joint actions (0,0), (0,1), (1,0), (1,1) get rewards 1, 2, 3, 4. Agent 0's completion k
    takes part in the joint actions with k0 = k: returns (1+2)/2 = 1.5 and (3+4)/2 = 3.5. Agent 1's completion k
    in those with k1 = k: (1+3)/2 = 2 and (2+4)/2 = 3. With raw advantages and no normalisation, these are the
    advantages."""
    config = make_config(
        num_generations=2,
        joint_mode="cross",
        advantage_mode="raw",
        advantage_normalization=False,
        max_new_tokens=4,
        max_steps=1,
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, reward_func=lambda a, b: [1.0, 2.0, 3.0, 4.0], train_dataset=ITEMS, args=config
    )
    for model in trainer.agents:
        model.train()
    rollout = trainer.orchestrator.rollout([{"prompt": "Say something:"}] * 2)
    agent_0, agent_1 = (advantages.tolist() for advantages in rollout.agent_advantages)
    assert agent_0 == [1.5, 3.5]
    assert agent_1 == [2.0, 3.0]
