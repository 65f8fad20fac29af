"""Checkpoint integrity: one live run per directory, a verified manifest, settings that must not change on resume,
a writable directory checked up front, and a full disk that leaves no partial checkpoint."""

import enum
import errno
import json
import os
import shutil

import pytest
import torch
from datasets import Dataset
from helpers import length_ratio_reward
from transformers import TrainerCallback

from comlrl_trl.trainers.reinforce import MAGRPOTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _trainer(path, make_config, epochs=1, callbacks=None, reward=length_ratio_reward, **config):
    settings = dict(
        num_train_epochs=epochs, num_generations=2, max_new_tokens=6, learning_rate=0.05, lr_scheduler_type="constant"
    )
    settings.update(config)
    return MAGRPOTrainer(
        agent_model=path, reward_func=reward, train_dataset=ITEMS, args=make_config(**settings), callbacks=callbacks
    )


@pytest.fixture
def saved(qwen_path, make_config, tmp_path):
    """One epoch saved into `tmp_path/ckpt/checkpoint-1`."""
    _trainer(qwen_path, make_config).train(checkpoint_dir=tmp_path / "ckpt")
    return tmp_path / "ckpt" / "checkpoint-1"


class _SecondRun(TrainerCallback):
    """Starts a second run on the same checkpoint directory while the first one trains."""

    def __init__(self, start):
        self.start, self.error = start, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            try:
                self.start()
            except RuntimeError as error:
                self.error = error


def test_a_second_live_run_on_the_same_directory_refuses(qwen_path, make_config, tmp_path):
    root = tmp_path / "ckpt"
    second = _trainer(qwen_path, make_config)
    probe = _SecondRun(lambda: second.train(checkpoint_dir=root))
    first = _trainer(qwen_path, make_config, callbacks=[probe])
    first.train(checkpoint_dir=root)
    assert probe.error is not None and "in use by another live training run" in str(probe.error)
    assert f"pid {os.getpid()}" in str(probe.error)
    assert second.state.global_step == 0  # it refused before training
    assert sorted(os.listdir(root)) == ["checkpoint-1"]  # the first run finished; its lock is gone
    _trainer(qwen_path, make_config, epochs=2).train(resume_from_checkpoint=True, checkpoint_dir=root)


def test_a_stale_lock_and_staging_of_a_dead_run_do_not_block_or_leak(qwen_path, make_config, tmp_path):
    root = tmp_path / "ckpt"
    leftover = root / ".checkpoint-1.0123456789abcdef.partial" / "agent_0"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"weights of another run")
    (root / ".comlrl_trl.lock").write_text("999999999\n")  # a crashed run's file: no live flock on it
    _trainer(qwen_path, make_config).train(checkpoint_dir=root)
    assert sorted(os.listdir(root)) == ["checkpoint-1"]
    assert (root / "checkpoint-1" / "agent_0" / "model.safetensors").stat().st_size > 1000


def _damage(checkpoint, how):
    if how == "swap agents":
        os.replace(checkpoint / "agent_0", checkpoint / "tmp")
        os.replace(checkpoint / "agent_1", checkpoint / "agent_0")
        os.replace(checkpoint / "tmp", checkpoint / "agent_1")
    elif how == "flip a byte":
        path = checkpoint / "agent_0" / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        (checkpoint / how).unlink()


@pytest.mark.parametrize(
    "how, named",
    [
        ("agent_1/optimizer.pt", "agent_1/optimizer.pt is missing"),
        ("agent_0/scheduler.pt", "agent_0/scheduler.pt is missing"),
        ("rng_state.pth", "rng_state.pth is missing"),
        ("flip a byte", "agent_0/model.safetensors is damaged"),
        ("swap agents", "agent_0/model.safetensors is damaged"),
    ],
)
def test_resume_verifies_every_file(qwen_path, make_config, saved, tmp_path, how, named):
    copy = tmp_path / "copy" / "checkpoint-1"
    shutil.copytree(saved, copy)
    _damage(copy, how)
    resumed = _trainer(qwen_path, make_config, epochs=2)
    with pytest.raises(ValueError, match="not as it was saved") as raised:
        resumed.train(resume_from_checkpoint=str(copy))
    assert named in str(raised.value)
    if how == "swap agents":
        assert "agent_1/model.safetensors is damaged" in str(raised.value)
    assert resumed.state.global_step == 0


def test_resume_refuses_changed_settings_and_lists_them(qwen_path, make_config, saved):
    changed = _trainer(
        qwen_path,
        make_config,
        epochs=2,
        learning_rate=0.01,
        lr_scheduler_type="linear",
        advantage_mode="rloo",
        beta=0.1,
        temperature=0.7,
        loss_type="grpo",
    )
    with pytest.raises(ValueError) as raised:
        changed.train(resume_from_checkpoint=str(saved))
    message = str(raised.value)
    for line in (
        "learning_rate: checkpoint has 0.05, this trainer has 0.01",
        "lr_scheduler_type: checkpoint has 'constant', this trainer has 'linear'",
        "advantage_mode: checkpoint has 'mean', this trainer has 'rloo'",
        "beta: checkpoint has 0.0, this trainer has 0.1",
        "temperature: checkpoint has 0.6, this trainer has 0.7",
        "loss_type: checkpoint has 'dapo', this trainer has 'grpo'",
    ):
        assert line in message
    assert "num_train_epochs and max_steps may grow" in message
    more_epochs = _trainer(qwen_path, make_config, epochs=2)
    more_epochs.train(resume_from_checkpoint=str(saved))
    assert more_epochs.state.global_step == 2 * 4


def _set_world_size(checkpoint, world_size):
    """Rewrite the recorded world size (the metadata is not in its own manifest)."""
    path = checkpoint / "comlrl_trl_checkpoint.json"
    metadata = json.loads(path.read_text())
    metadata["world_size"] = world_size
    path.write_text(json.dumps(metadata))


def test_a_checkpoint_records_its_world_size_and_resume_refuses_another(qwen_path, make_config, saved, tmp_path):
    """A checkpoint of 2 processes resumed by 1 is refused before anything loads, with both numbers and the fix."""
    assert json.loads((saved / "comlrl_trl_checkpoint.json").read_text())["world_size"] == 1
    copy = tmp_path / "copy" / "checkpoint-1"
    shutil.copytree(saved, copy)
    _set_world_size(copy, 2)
    resumed = _trainer(qwen_path, make_config, epochs=2)
    with pytest.raises(ValueError) as raised:
        resumed.train(resume_from_checkpoint=str(copy))
    message = str(raised.value)
    assert f"Cannot resume from {copy}: it was saved by a run of 2 processes and this run has 1." in message
    assert "Resume with 2 processes, or start a new run from the checkpoint's weights" in message
    assert resumed.state.global_step == 0
    _set_world_size(copy, None)  # a checkpoint from before the world size was recorded: not checked
    unrecorded = _trainer(qwen_path, make_config, epochs=2)
    unrecorded.train(resume_from_checkpoint=str(copy))
    assert unrecorded.state.global_step == 2 * 4


def test_the_world_size_refusal_under_deepspeed_names_the_conversion():
    from comlrl_trl.checkpoint import check_world_size

    check_world_size(4, 4, "ckpt/checkpoint-3", deepspeed=True)
    check_world_size(None, 4, "ckpt/checkpoint-3", deepspeed=True)
    with pytest.raises(ValueError) as raised:
        check_world_size(16, 8, "ckpt/checkpoint-3", deepspeed=True)
    message = str(raised.value)
    assert "Cannot resume from ckpt/checkpoint-3: it was saved by a run of 16 processes and this run has 8." in message
    assert "--num_processes 16" in message and "zero_to_fp32.py" in message and "ds_to_universal.py" in message


class _Calls(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def test_an_unwritable_checkpoint_dir_fails_before_training(qwen_path, make_config, tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    calls = _Calls()
    trainer = _trainer(qwen_path, make_config, callbacks=[calls])
    with pytest.raises(PermissionError, match="checkpoint_dir=.* is not writable"):
        trainer.train(checkpoint_dir=tmp_path / "a_file" / "ckpt")
    assert calls.steps == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoint_dir_fails_before_training(qwen_path, make_config, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    root.chmod(0o555)
    calls = _Calls()
    with pytest.raises(PermissionError, match="not writable"):
        _trainer(qwen_path, make_config, callbacks=[calls]).train(checkpoint_dir=root)
    assert calls.steps == 0


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4374"),  # torch.save's own
    ],
)
def test_a_full_disk_says_so_and_leaves_no_partial_checkpoint(qwen_path, make_config, tmp_path, monkeypatch, failure):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):  # the second epoch's checkpoint: the disk is full now
            raise failure
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    root = tmp_path / "ckpt"
    with pytest.raises(OSError, match="No space left on device") as raised:
        _trainer(qwen_path, make_config, epochs=2).train(checkpoint_dir=root)
    assert raised.value.errno == errno.ENOSPC and "checkpoint-2" in str(raised.value)
    assert sorted(os.listdir(root)) == ["checkpoint-1"]  # no partial directory, no lock left behind
    monkeypatch.setattr(torch, "save", real_save)
    resumed = _trainer(qwen_path, make_config, epochs=2)
    resumed.train(resume_from_checkpoint=True, checkpoint_dir=root)
    assert resumed.state.global_step == 2 * 4


def _marlhf(path, make_config, **overrides):
    """A MARLHF trainer of one RL epoch: its checkpoints are checkpoint-1 (reward-model stage) and checkpoint-2 (RL)."""
    from comlrl_trl.trainers.preference import MARLHFConfig, MARLHFTrainer

    settings = dict(
        config_cls=MARLHFConfig,
        num_generations=2,
        max_new_tokens=6,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        preference_num_candidates=4,
        preference_pairs_per_sample=2,
        reward_learning_rate=1e-3,
        reward_num_train_epochs=1,
        num_train_epochs=1,
    )
    settings.update(overrides)
    return MARLHFTrainer(
        agent_model=path,
        train_dataset=ITEMS,
        args=make_config(**settings),
        reward_func=lambda a, b: [float(len(y) // 8 - len(x) // 8) for x, y in zip(a, b)],
    )


def test_marlhf_checkpoints_are_verified_and_keep_their_settings(qwen_path, make_config, tmp_path):
    def build(**overrides):
        return _marlhf(qwen_path, make_config, **overrides)

    build().train(checkpoint_dir=tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-1", "checkpoint-2"]  # no lock, no staging left
    damaged = tmp_path / "damaged" / "checkpoint-2"
    shutil.copytree(tmp_path / "ckpt" / "checkpoint-2", damaged)
    path = damaged / "preference" / "reward_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not as it was saved") as raised:
        build(num_train_epochs=2).train(resume_from_checkpoint=str(damaged))
    assert "preference/reward_model.safetensors is damaged" in str(raised.value)
    # The RL stage's epoch checkpoint inside it is verified when the RL stage resumes it, naming its own path.
    shutil.rmtree(damaged.parent)
    shutil.copytree(tmp_path / "ckpt" / "checkpoint-2", damaged)
    (damaged / "rl" / "agent_1" / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=f"Cannot resume from {damaged / 'rl'}: the checkpoint is not as") as raised:
        build(num_train_epochs=2).train(resume_from_checkpoint=str(damaged))
    assert "\n  agent_1/optimizer.pt is missing" in str(raised.value)
    (damaged / "rl" / "comlrl_trl_checkpoint.json").unlink()  # its own metadata is in the outer manifest
    with pytest.raises(ValueError, match=f"Cannot resume from {damaged}: the checkpoint is not as") as raised:
        build(num_train_epochs=2).train(resume_from_checkpoint=str(damaged))
    assert "rl/comlrl_trl_checkpoint.json is missing" in str(raised.value)
    with pytest.raises(ValueError, match="reward_learning_rate: checkpoint has 0.001, this trainer has 0.01"):
        build(num_train_epochs=2, reward_learning_rate=1e-2).train(
            resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-2")
        )


@pytest.mark.parametrize("stage", ["checkpoint-1", "checkpoint-2"])  # after the reward model, after the RL epoch
def test_marlhf_and_the_team_refuse_a_changed_setting_with_the_same_message(
    qwen_path, make_config, saved, tmp_path, stage
):
    """One compatibility check for every family: a MARLHF stage checkpoint resumed with another learning rate is
    refused with the team's message, line for line (only the path differs)."""
    _marlhf(qwen_path, make_config).train(checkpoint_dir=tmp_path / "marlhf")
    messages = []
    for trainer, checkpoint in (
        (_trainer(qwen_path, make_config, epochs=2, learning_rate=0.01), saved),
        (_marlhf(qwen_path, make_config, num_train_epochs=2, learning_rate=0.01), tmp_path / "marlhf" / stage),
    ):
        with pytest.raises(ValueError) as raised:
            trainer.train(resume_from_checkpoint=str(checkpoint))
        messages.append(str(raised.value).replace(str(checkpoint), "<checkpoint>"))
    assert messages[0] == messages[1]
    assert messages[1].splitlines()[1:] == [
        "  learning_rate: checkpoint has 0.05, this trainer has 0.01",
        "These settings change the result, so a resumed run must keep the checkpoint's values (num_train_epochs and "
        "max_steps may grow); or start a new run.",
    ]


def test_a_full_disk_leaves_no_partial_marlhf_checkpoint(qwen_path, make_config, tmp_path, monkeypatch):
    """The team's writer saves MARLHF's stages: a full disk while wrapping the RL epoch (checkpoint-2) says so, keeps
    the reward-model stage's checkpoint-1 intact and leaves no partial checkpoint-2; the run resumes from checkpoint-1
    and ends as an uninterrupted one."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if os.path.basename(os.path.dirname(str(f))).startswith(".checkpoint-2."):  # the MARLHF staging directory
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    root = tmp_path / "ckpt"
    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(OSError, match="No space left on device") as raised:
        _marlhf(qwen_path, make_config).train(checkpoint_dir=root)
    assert raised.value.errno == errno.ENOSPC and "checkpoint-2" in str(raised.value)
    assert [name for name in os.listdir(root) if "checkpoint" in name] == ["checkpoint-1"]
    monkeypatch.setattr(torch, "save", real_save)
    resumed = _marlhf(qwen_path, make_config)
    resumed.train(resume_from_checkpoint=True, checkpoint_dir=root)
    assert sorted(os.listdir(root)) == ["checkpoint-1", "checkpoint-2"]
    straight = _marlhf(qwen_path, make_config)
    straight.train()
    for a, b in zip(straight.agents, resumed.agents, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_a_filesystem_without_flock_warns_once_and_trains(qwen_path, make_config, tmp_path, monkeypatch):
    """NFS mounted nolock or Lustre answer flock with ENOLCK/EOPNOTSUPP (not BlockingIOError): a warning, once per
    process, and the run saves and resumes without the lock (it crashed at start before)."""
    from comlrl_trl import checkpoint

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(checkpoint.fcntl, "flock", no_flock)
    monkeypatch.setattr(checkpoint, "_warned_no_flock", False)
    root = tmp_path / "ckpt"
    with pytest.warns(UserWarning, match="has no working flock \\(No locks available\\)") as caught:
        _trainer(qwen_path, make_config).train(checkpoint_dir=root)
        _trainer(qwen_path, make_config, epochs=2).train(resume_from_checkpoint=True, checkpoint_dir=root)
    assert len([w for w in caught if "flock" in str(w.message)]) == 1  # once, not per run or save
    assert sorted(os.listdir(root)) == ["checkpoint-1", "checkpoint-2"]  # no lock file left that looks held


def test_a_flock_error_other_than_no_support_is_not_the_contended_lock(tmp_path, monkeypatch):
    """EOPNOTSUPP takes the same fallback; a lock held by another process (BlockingIOError) still refuses."""
    from comlrl_trl import checkpoint

    monkeypatch.setattr(checkpoint, "_warned_no_flock", False)
    monkeypatch.setattr(
        checkpoint.fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "Not supported"))
    )
    lock = checkpoint.RunLock()
    with pytest.warns(UserWarning, match="Not supported"):
        lock.acquire(str(tmp_path))
    lock.release()
    monkeypatch.setattr(checkpoint.fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(BlockingIOError()))
    with pytest.raises(RuntimeError, match="in use by another live training run"):
        checkpoint.RunLock().acquire(str(tmp_path))


def test_hashing_on_threads_gives_the_digests_of_one_thread(tmp_path):
    """The manifest hashes files in parallel: every file's digest and size is the one hashlib gives it alone."""
    import hashlib

    from comlrl_trl import checkpoint

    contents = {f"agent_{i}/shard-{j}.bin": os.urandom(1000 * (i + 1) + j) for i in range(3) for j in range(4)}
    for relative, data in contents.items():
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        (tmp_path / relative).write_bytes(data)
    manifest = checkpoint.build_manifest(str(tmp_path))
    assert list(manifest) == sorted(contents)
    for relative, data in contents.items():
        assert manifest[relative] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_nested_checkpoint_keeps_its_digests_and_is_left_to_its_own_verification(tmp_path, monkeypatch):
    """MARLHF moves the RL stage's hashed epoch checkpoint into its own: the outer manifest takes the recorded digest
    of each of its files whose size is unchanged instead of reading it again (hashed: the outer files, the nested
    metadata and a file whose size changed), and `verify_checkpoint(skip=...)` checks the nested metadata but leaves
    the nested files to the nested checkpoint's own verification."""
    import hashlib

    from comlrl_trl import checkpoint

    (tmp_path / "rl" / "agent_0").mkdir(parents=True)
    (tmp_path / "preference.json").write_bytes(b"pairs")
    (tmp_path / "rl" / "agent_0" / "model.bin").write_bytes(b"weights")
    (tmp_path / "rl" / "agent_0" / "grown.bin").write_bytes(b"state, longer than when it was hashed")
    recorded = {
        "agent_0/model.bin": {"size": 7, "sha256": "a" * 64},  # not the real digest: proves it was not re-read
        "agent_0/grown.bin": {"size": 5, "sha256": "b" * 64},
    }
    (tmp_path / "rl" / checkpoint.METADATA_NAME).write_text(json.dumps({checkpoint.MANIFEST_KEY: recorded}))
    read = []
    sha256 = checkpoint._sha256
    monkeypatch.setattr(
        checkpoint, "_sha256", lambda path: read.append(os.path.relpath(path, tmp_path)) or sha256(path)
    )

    manifest = checkpoint.build_manifest(str(tmp_path))

    assert sorted(read) == ["preference.json", "rl/agent_0/grown.bin", "rl/comlrl_trl_checkpoint.json"]
    assert manifest["rl/agent_0/model.bin"] == {"size": 7, "sha256": "a" * 64}
    grown = b"state, longer than when it was hashed"
    assert manifest["rl/agent_0/grown.bin"] == {"size": len(grown), "sha256": hashlib.sha256(grown).hexdigest()}
    assert manifest["preference.json"] == {"size": 5, "sha256": hashlib.sha256(b"pairs").hexdigest()}

    checkpoint.write_metadata(str(tmp_path), {"version": 1}, manifest)
    read.clear()
    checkpoint.verify_checkpoint(str(tmp_path), skip=("rl",))  # model.bin's recorded digest is not checked here
    assert sorted(read) == ["preference.json", "rl/comlrl_trl_checkpoint.json"]
    with pytest.raises(ValueError, match="rl/agent_0/model.bin is damaged"):
        checkpoint.verify_checkpoint(str(tmp_path))  # without skip every file is checked


# Every setting a resume must keep, written out here (not read from checkpoint.RESULT_SETTINGS), so that one left
# out of the comparison fails its own case (`discount` once was). RESULT_SETTINGS also lists `warmup_ratio`, which
# the installed transformers no longer has (warmup_steps takes a fraction there).
COMPARED_SETTINGS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "optim",
    "max_grad_norm",
    "seed",
    "shuffle_dataset",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "num_generations",
    "advantage_mode",
    "scale_rewards",
    "beta",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_prompt_length",
    "max_completion_length",
    "discount",
    "early_termination_threshold",
    "turn_gradient_weights",
    "external_prompt_passthrough",
    "critic_type",
    "critic_learning_rate",
    "value_loss_coef",
    "value_clip_range",
    "agent_overrides",
    "dpo_beta",
    "use_reference_model",
    "pair_selection",
    "preference_num_candidates",
    "preference_pairs_per_sample",
)


def _changed(value):
    """A different value of the same kind (the comparison only serialises it)."""
    if isinstance(value, enum.Enum):
        return next(member for member in type(value) if member != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, dict):
        return {**value, "changed": 1}
    if isinstance(value, list):
        return [*value, 1]
    return 1  # None


@pytest.mark.parametrize("name", COMPARED_SETTINGS)
def test_resume_refuses_a_change_of_every_compared_setting(name, make_config):
    from comlrl_trl.checkpoint import check_compatible, result_settings
    from comlrl_trl.trainers.actor_critic.ac_config import IACConfig
    from comlrl_trl.trainers.preference.madpo_config import MADPOConfig

    configs = [make_config(), make_config(IACConfig), make_config(MADPOConfig, preference_num_candidates=4)]
    config = next((config for config in configs if hasattr(config, name)), None)
    assert config is not None, f"no configuration has {name}"
    saved = json.loads(json.dumps(result_settings(config)))  # as the checkpoint's metadata gives it back
    before = getattr(config, name)
    setattr(config, name, _changed(before))
    with pytest.raises(ValueError, match=f"does not match this trainer.\n  {name}: checkpoint has"):
        check_compatible(saved, result_settings(config), "checkpoint-1")
    setattr(config, name, before)
    check_compatible(saved, result_settings(config), "checkpoint-1")  # unchanged: accepted


def test_trl_save_strategy_locks_the_output_dir(qwen_path, make_config, tmp_path):
    """Saves through TRL's save_strategy go into output_dir: a live run holding it there blocks a second one."""
    from comlrl_trl.checkpoint import RunLock

    out = tmp_path / "out"
    holder = RunLock()
    holder.acquire(str(out))
    try:
        trainer = _trainer(qwen_path, make_config, save_strategy="steps", save_steps=1, output_dir=str(out))
        with pytest.raises(RuntimeError, match="in use by another live training run"):
            trainer.train()
        assert trainer.state.global_step == 0  # refused before the first step
    finally:
        holder.release()
    assert not [name for name in os.listdir(out) if name.startswith("checkpoint-")]
