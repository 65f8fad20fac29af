"""output_dir belongs to one run: a live run in another process is refused with its pid and host, a finished run's
results are not overwritten without overwrite_output_dir, and bad paths (output_dir, models, checkpoints) get errors
that name the argument, the value and the fix when the config or trainer is built."""

import gc
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from datasets import Dataset
from helpers import length_ratio_reward

from comlrl_trl import checkpoint
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _trainer(path, make_config, epochs=1, **config):
    settings = dict(num_train_epochs=epochs, num_generations=2, max_new_tokens=6, learning_rate=0.05)
    settings.update(config)
    return MAGRPOTrainer(
        agent_model=path, reward_func=length_ratio_reward, train_dataset=ITEMS, args=make_config(**settings)
    )


# ----- one live run per output_dir -----

_HOLDER = textwrap.dedent(
    """
    import fcntl, os, socket, sys, time
    os.makedirs(sys.argv[1], exist_ok=True)
    file = open(os.path.join(sys.argv[1], ".comlrl_trl.lock"), "a+")
    fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    file.truncate(0)
    file.write(f"{os.getpid()} {socket.gethostname()}\\n")
    file.flush()
    print("locked", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def other_run(tmp_path):
    """Another live process holding tmp_path/out the way a training run holds its output_dir."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_into_a_live_runs_output_dir_is_refused_with_its_pid_and_host(qwen_path, make_config, other_run):
    trainer = _trainer(qwen_path, make_config)  # default save_strategy="no": no checkpoint directory at all
    with pytest.raises(RuntimeError, match="in use by another live training run") as raised:
        trainer.train()
    assert f"pid {other_run.pid} on host {socket.gethostname()}" in str(raised.value)
    assert trainer.state.global_step == 0  # refused before training


def test_the_lock_file_names_this_run_and_is_held_while_the_trainer_lives(qwen_path, make_config, tmp_path):
    trainer = _trainer(qwen_path, make_config)
    trainer.train()
    lock = tmp_path / "out" / ".comlrl_trl.lock"
    assert lock.read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    # held after train() (a recipe writes models/ and metrics.json after it): another process cannot take it
    probe = "import fcntl, sys; fcntl.flock(open(sys.argv[1], 'a+').fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    assert subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True).returncode != 0
    again = _trainer(qwen_path, make_config, epochs=2)
    again.train()  # another trainer of this process may train into it, one after the other
    del trainer, again
    gc.collect()
    assert not lock.exists()  # released with the last trainer that held it


# ----- a finished run's results -----


def _finished_run_left(output_dir):
    """What a finished recipe run leaves in output_dir (as if another process had written it)."""
    (output_dir / "models").mkdir(parents=True)
    (output_dir / "models" / "team_settings.json").write_text("{}")
    (output_dir / "metrics.json").write_text("{}")


def test_a_new_run_does_not_overwrite_a_finished_runs_results(qwen_path, make_config, tmp_path):
    _finished_run_left(tmp_path / "out")
    trainer = _trainer(qwen_path, make_config)
    with pytest.raises(
        FileExistsError, match="holds the results of an earlier run \\(models, metrics.json\\)"
    ) as raised:
        trainer.train()
    assert "overwrite_output_dir=True" in str(raised.value) and trainer.state.global_step == 0
    assert (tmp_path / "out" / "metrics.json").read_text() == "{}"


def test_overwrite_output_dir_lets_a_new_run_replace_them(qwen_path, make_config, tmp_path):
    _finished_run_left(tmp_path / "out")
    trainer = _trainer(qwen_path, make_config, overwrite_output_dir=True)
    trainer.train()
    assert trainer.state.global_step == 4
    assert MAGRPOConfig(output_dir=str(tmp_path / "x"), overwrite_output_dir=True).overwrite_output_dir


def test_resuming_a_run_into_its_own_output_dir_still_works(qwen_path, make_config, tmp_path):
    first = _trainer(qwen_path, make_config)
    first.train(checkpoint_dir=tmp_path / "ckpt")
    first.save_model()  # its results: agent_i/ and team_settings.json in output_dir
    checkpoint._release_output_dirs()  # as when that run's process exits
    with pytest.raises(FileExistsError, match="team_settings.json"):
        _trainer(qwen_path, make_config, epochs=2).train()  # a fresh run would overwrite them
    checkpoint._release_output_dirs()
    resumed = _trainer(qwen_path, make_config, epochs=2)
    resumed.train(resume_from_checkpoint=True, checkpoint_dir=tmp_path / "ckpt")
    assert resumed.state.global_step == 8


# ----- clear errors for bad paths -----


def test_an_output_dir_that_is_a_file_is_refused_when_the_config_is_built(tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(ValueError, match="output_dir='.*taken' is a file: output_dir must be a directory"):
        MAGRPOConfig(output_dir=str(tmp_path / "taken"))
    with pytest.raises(ValueError, match="is inside '.*taken', which is a file"):
        MAGRPOConfig(output_dir=str(tmp_path / "taken" / "run"))


@pytest.mark.parametrize(
    "source, message",
    [
        ("./my_modle", "agent_model='./my_modle': no such directory"),
        ("~/no/such/model", "agent_model='~/no/such/model': no such directory"),
        ("empty_dir", "is a directory without config.json, so it is not a model"),
        ("someone/not-cached-model", "HF_HUB_OFFLINE is set, so it must come from the Hub cache"),
    ],
)
def test_a_model_path_that_is_no_model_is_named_with_the_fix(make_config, tmp_path, monkeypatch, source, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=message):
        MAGRPOTrainer(agent_model=source, reward_func=length_ratio_reward, train_dataset=ITEMS, args=make_config())


def test_agents_entries_are_named_by_index(qwen_path, make_config, tmp_path):
    partial = str(tmp_path / "outputs" / "run" / "models" / "agent_1")  # its parent directories exist in part
    (tmp_path / "outputs").mkdir()
    with pytest.raises(ValueError, match=r"agents\[1\]='.*agent_1': no such directory"):
        MAGRPOTrainer(
            agents=[qwen_path, partial], reward_func=length_ratio_reward, train_dataset=ITEMS, args=make_config()
        )


def test_resuming_from_a_checkpoint_that_was_never_written_lists_those_that_exist(qwen_path, make_config, tmp_path):
    _trainer(qwen_path, make_config).train(checkpoint_dir=tmp_path / "ckpt")
    resumed = _trainer(qwen_path, make_config, epochs=2)
    with pytest.raises(FileNotFoundError) as raised:
        resumed.train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-7"))
    message = str(raised.value)
    assert "checkpoint-7': it does not exist" in message and "are: checkpoint-1;" in message
    assert "interrupted" not in message
