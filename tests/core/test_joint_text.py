"""The joint text that centralised critics and reward models read."""

import pytest

from comlrl_trl.joint_text import joint_text, prompt_text


def test_prompts_and_responses_in_actor_order():
    assert joint_text(["Plan it.", "Build it."], ["a plan", "a house"]) == (
        "[Agent 1 prompt]\nPlan it.\n\n[Agent 1 response]\na plan\n\n"
        "[Agent 2 prompt]\nBuild it.\n\n[Agent 2 response]\na house"
    )


def test_prompts_only_for_a_state_value():
    assert joint_text(["x", "y", "z"]) == "[Agent 1 prompt]\nx\n\n[Agent 2 prompt]\ny\n\n[Agent 3 prompt]\nz"


def test_chat_prompts_are_rendered_as_role_lines():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompt_text(messages) == "system: Be brief.\nuser: Hi"
    assert (
        joint_text([messages], ["Hello"])
        == "[Agent 1 prompt]\nsystem: Be brief.\nuser: Hi\n\n[Agent 1 response]\nHello"
    )


def test_one_response_per_prompt():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        joint_text(["a", "b"], ["only one"])
