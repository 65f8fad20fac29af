"""comlrl_trl.algorithms: every name users type maps to its trainer and configuration classes; an unknown name is a
ValueError that lists the known ones; the module imports no trainer until a name is looked up."""

import dataclasses
import subprocess
import sys
import typing

import pytest

from comlrl_trl.algorithms import (
    ACTOR_CRITIC_ALGORITHMS,
    ALGORITHMS,
    REINFORCE_ALGORITHMS,
    RL_STAGE_ALGORITHMS,
    Algorithm,
    get_algorithm,
)
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.preference import (
    MADPOConfig,
    MADPOTrainer,
    MARLHFConfig,
    MARLHFIterConfig,
    MARLHFIterTrainer,
    MARLHFTrainer,
)
from comlrl_trl.trainers.reinforce import (
    CentralizedMAGRPOConfig,
    CentralizedMAGRPOTrainer,
    MAGRPOConfig,
    MAGRPOTrainer,
    MAREINFORCEConfig,
    MAREINFORCETrainer,
    MAReMaxConfig,
    MAReMaxTrainer,
    MARLOOConfig,
    MARLOOTrainer,
)


EXPECTED = {
    "magrpo": (MAGRPOTrainer, MAGRPOConfig, "reinforce", "mean"),
    "mareinforce": (MAREINFORCETrainer, MAREINFORCEConfig, "reinforce", "raw"),
    "marloo": (MARLOOTrainer, MARLOOConfig, "reinforce", "rloo"),
    "maremax": (MAReMaxTrainer, MAReMaxConfig, "reinforce", "max"),
    "centralized_magrpo": (CentralizedMAGRPOTrainer, CentralizedMAGRPOConfig, "reinforce", None),
    "iac": (IACTrainer, IACConfig, "actor_critic", None),
    "maac": (MAACTrainer, MAACConfig, "actor_critic", None),
    "madpo": (MADPOTrainer, MADPOConfig, "preference", None),
    "marlhf": (MARLHFTrainer, MARLHFConfig, "preference", None),
    "marlhf_iter": (MARLHFIterTrainer, MARLHFIterConfig, "preference", None),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_name_maps_to_its_classes(name):
    trainer_cls, config_cls, family, advantage_mode = EXPECTED[name]
    assert get_algorithm(name) == Algorithm(name, trainer_cls, config_cls, family, advantage_mode)
    assert trainer_cls.__module__.startswith(f"comlrl_trl.trainers.{family}.")


def test_name_groups():
    assert ALGORITHMS == (
        "magrpo",
        "mareinforce",
        "marloo",
        "maremax",
        "centralized_magrpo",
        "iac",
        "maac",
        "madpo",
        "marlhf",
        "marlhf_iter",
    )
    assert REINFORCE_ALGORITHMS == ("magrpo", "mareinforce", "marloo", "maremax")
    assert ACTOR_CRITIC_ALGORITHMS == ("iac", "maac")
    assert RL_STAGE_ALGORITHMS == ("magrpo", "mareinforce", "marloo", "maremax", "iac", "maac")


def test_names_agree_with_the_classes():
    """A trainer built without args uses the registered config class; a REINFORCE baseline's advantage_mode is its
    config class's default; MARLHF's online stage accepts exactly RL_STAGE_ALGORITHMS."""
    for name in ALGORITHMS:
        algorithm = get_algorithm(name)
        default_config_cls = getattr(algorithm.trainer_cls, "default_config_cls", algorithm.config_cls)
        assert default_config_cls is algorithm.config_cls, name
    for name in REINFORCE_ALGORITHMS:
        algorithm = get_algorithm(name)
        assert {f.name: f.default for f in dataclasses.fields(algorithm.config_cls)}[
            "advantage_mode"
        ] == algorithm.advantage_mode
    rl_algorithm = {f.name: f for f in dataclasses.fields(MARLHFConfig)}["rl_algorithm"]
    assert typing.get_args(rl_algorithm.type) == RL_STAGE_ALGORITHMS


@pytest.mark.parametrize("name", ["grpo", "MAGRPO", "", "iac "])
def test_unknown_name_lists_the_known_ones(name):
    with pytest.raises(ValueError) as error:
        get_algorithm(name)
    message = str(error.value)
    assert repr(name) in message
    assert "magrpo, mareinforce, marloo, maremax, centralized_magrpo, iac, maac, madpo, marlhf, marlhf_iter" in message


def test_import_loads_no_trainer():
    """Trainer modules may import comlrl_trl.algorithms without a cycle: it imports them only on lookup."""
    code = (
        "import sys, comlrl_trl.algorithms as a; assert not [m for m in sys.modules if m.startswith("
        "'comlrl_trl.trainers')]; a.get_algorithm('iac'); assert 'comlrl_trl.trainers.actor_critic' in sys.modules"
        "; assert 'comlrl_trl.trainers.preference' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
