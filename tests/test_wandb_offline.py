"""W&B logging against a real offline run: no mocks, the run file is read back and checked.

`wandb` writes every offline run to `<dir>/wandb/offline-run-*/run-*.wandb`, a LevelDB-style log of protobuf
`Record`s. wandb <= 0.2x shipped a Python reader (`wandb.sdk.internal.datastore`); wandb 0.31 moved it into the Go
core. The test uses the Python reader where it exists and otherwise decodes the (small, stable) log framing itself;
the records are always parsed with wandb's own `wandb.proto.wandb_internal_pb2.Record`.
"""

import glob
import json
import math
import struct
import zlib
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import length_ratio_reward

from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


wandb = pytest.importorskip("wandb")
wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")


# ----- reading an offline run file -----

_BLOCK_LEN = 32768
_HEADER_LEN = 7  # both the file header (":W&B", magic, version) and every record header (crc32, length, type)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _scan_with_wandb(path):
    """wandb's own reader (wandb.sdk.internal.datastore), where this wandb version still ships it."""
    from wandb.sdk.internal import datastore

    ds = datastore.DataStore()
    ds.open_for_scan(path)
    while True:
        data = ds.scan_data()
        if data is None:
            break
        yield data


def _scan_log(path):
    """The same scan for wandb versions whose reader lives in wandb-core: LevelDB log blocks, checksums verified."""
    raw = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", raw[:_HEADER_LEN])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"not a W&B run file: {raw[:_HEADER_LEN]!r}"
    pos, pending = _HEADER_LEN, None
    while pos + _HEADER_LEN <= len(raw):
        if _BLOCK_LEN - pos % _BLOCK_LEN < _HEADER_LEN:  # block trailer: zero padding
            pos += _BLOCK_LEN - pos % _BLOCK_LEN
            continue
        checksum, length, kind = struct.unpack("<IHB", raw[pos : pos + _HEADER_LEN])
        chunk = raw[pos + _HEADER_LEN : pos + _HEADER_LEN + length]
        pos += _HEADER_LEN + length
        if kind == 0 and length == 0:
            continue
        assert len(chunk) == length, "truncated record"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, "record checksum mismatch"
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = None
        else:
            raise AssertionError(f"unknown record type {kind}")


def read_run_file(path):
    """All records of an offline run file, parsed with wandb's protobuf `Record`."""
    try:
        chunks = list(_scan_with_wandb(path))
    except ImportError:
        chunks = list(_scan_log(path))
    records = []
    for data in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        records.append(record)
    return records


def _history_rows(records):
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def _config(records):
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


# ----- fixtures -----


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """A fresh W&B setup in offline mode with every W&B directory under tmp_path."""
    wandb.finish()
    wandb.teardown()  # the wandb singleton reads the environment once: start from a fresh one
    base = tmp_path / "wandb-env"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name, sub in (
        ("WANDB_DIR", "dir"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
    ):
        (base / sub).mkdir(parents=True)
        monkeypatch.setenv(name, str(base / sub))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield tmp_path
    wandb.finish()
    wandb.teardown()


def _datasets(n_train):
    train = Dataset.from_dict({"prompt": [f"Write a story about item {i}:" for i in range(n_train)]})
    eval_ = Dataset.from_dict({"prompt": ["Describe a city in the clouds:", "Invent a new holiday:"]})
    return train, eval_


# ----- tests -----


def test_offline_run_records_metrics_identity_and_config(offline_wandb, qwen_path, make_config):
    tmp_path = offline_wandb
    train, eval_ = _datasets(6)
    # K=2: every task item (one optimiser update) adds 2 env steps; logging_steps=4 logs the first update and every
    # 4th (env_step 2 and 8).
    config = make_config(num_generations=2, logging_steps=4, eval_interval=2, eval_num_samples=2)
    wandb_config = {
        "project": "comlrl-test",
        "name": "run-x",
        "tags": ["a", "b"],
        "dir": str(tmp_path / "wb"),
        "config_sections": {"dataset": {"name": "len"}, "output": {"verbose": False}},
    }
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=length_ratio_reward,
        train_dataset=train,
        eval_dataset=eval_,
        args=config,
        wandb_config=wandb_config,
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert wandb.run is not None and wandb.run.offline
    (records,) = _run_records(tmp_path)

    # metrics
    rows = _history_rows(records)
    logged = set().union(*rows)
    for key in (
        "turn_1/reward_mean",
        "turn_1/expected_return",
        "env_step",
        "agent_0/loss",
        "agent_1/loss",
        "eval/turn_1/reward_mean",
        "eval/turn_1/expected_return",
    ):
        assert key in logged, f"{key} was not logged; logged keys: {sorted(logged)}"
    for row in rows:
        for key, value in row.items():
            if key.startswith(("turn_", "eval/", "agent_")) and isinstance(value, float):
                assert math.isfinite(value), (key, value)

    train_rows = [row for row in rows if "turn_1/reward_mean" in row]
    steps = [row["env_step"] for row in train_rows]
    assert len(steps) >= 2, steps
    assert all(b > a for a, b in zip(steps, steps[1:])), steps
    assert all(b - a >= 4 for a, b in zip(steps, steps[1:])), f"training logs closer than logging_steps: {steps}"
    assert steps[0] == 2, steps  # the first optimiser step (one item, K=2) always logs
    assert max(steps) <= trainer.env_step == 6 * 2
    for row in train_rows:
        assert {"agent_0/loss", "agent_1/loss", "turn_1/expected_return"} <= set(row), sorted(row)

    eval_rows = [row for row in rows if "eval/turn_1/reward_mean" in row]
    assert len(eval_rows) >= 2  # before item 0 and every eval_interval items, plus the manual evaluate()
    assert eval_rows[-1]["eval/turn_1/reward_mean"] == pytest.approx(metrics["eval/turn_1/reward_mean"])
    assert eval_rows[-1]["env_step"] == trainer.env_step

    # identity and configuration
    runs = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert runs, "no run record"
    assert runs[0].project == "comlrl-test"
    assert runs[0].display_name == "run-x"
    assert list(runs[0].tags) == ["a", "b"]
    recorded = _config(records)
    assert recorded["algorithm"] == "MAGRPO"
    assert recorded["num_agents"] == 2
    assert recorded["num_generations"] == 2
    assert recorded["dataset"] == {"name": "len"}
    assert recorded["output"] == {"verbose": False}


def test_no_wandb_config_creates_no_run(offline_wandb, qwen_path, prompts_dataset, tmp_path):
    wandb.finish()
    assert wandb.run is None
    # The library defaults (report_to included): W&B is on only through wandb_config.
    config = MAGRPOConfig(
        output_dir=str(tmp_path / "out"),
        num_agents=2,
        num_generations=2,
        max_new_tokens=8,
        gradient_checkpointing=False,
        eval_interval=0,
        logging_steps=1,
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset.select(range(2)),
        args=config,
        wandb_config=None,
    )
    trainer.train()
    assert wandb.run is None
    assert not glob.glob(str(tmp_path / "**" / "*.wandb"), recursive=True)


def test_unknown_wandb_config_key_fails_at_construction(qwen_path, prompts_dataset, make_config):
    with pytest.raises(ValueError, match="projcet"):
        MAGRPOTrainer(
            agent_model=qwen_path,
            num_agents=2,
            reward_func=length_ratio_reward,
            train_dataset=prompts_dataset,
            args=make_config(),
            wandb_config={"projcet": "typo", "name": "run-x"},
        )


def _run_records(tmp_path):
    """The records of every finished run under tmp_path/wb.

    `wandb.finish()` returns once the run is handed to the W&B service, which may still be writing the run file (seen
    on a loaded CI machine: a file without its run record yet). Tearing the service down waits for every write.
    """
    wandb.finish()
    wandb.teardown()
    files = sorted(glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb")))
    return [read_run_file(path) for path in files]


def test_each_trainer_gets_its_own_run(offline_wandb, qwen_path, make_config):
    tmp_path = offline_wandb
    train, _ = _datasets(2)
    for name in ("run-1", "run-2"):
        trainer = MAGRPOTrainer(
            agent_model=qwen_path,
            reward_func=length_ratio_reward,
            train_dataset=train,
            args=make_config(num_generations=2),
            wandb_config={"project": "p", "name": name, "dir": str(tmp_path / "wb")},
        )
        trainer.train()
    names = sorted(
        next(r.run for r in records if r.WhichOneof("record_type") == "run").display_name
        for records in _run_records(tmp_path)
    )
    assert names == ["run-1", "run-2"]


def test_checkpoint_keeps_the_run_identity_for_resume(offline_wandb, qwen_path, make_config):
    from comlrl_trl.utils import read_checkpoint_metadata

    tmp_path = offline_wandb
    train, _ = _datasets(2)
    wandb_config = {"project": "p", "name": "resumable", "dir": str(tmp_path / "wb")}
    first = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=train,
        args=make_config(num_generations=2),
        wandb_config=wandb_config,
    )
    first.train(checkpoint_dir=tmp_path / "ckpt")
    run_id = wandb.run.id
    wandb.finish()

    checkpoint = str(tmp_path / "ckpt" / "checkpoint-1")
    identity = read_checkpoint_metadata(checkpoint)["wandb"]  # the page-003 snippet
    assert identity == {"id": run_id, "project": "p"}
    if identity and "id" not in wandb_config and "resume" not in wandb_config:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}
    resumed = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=train,
        args=make_config(num_generations=2, num_train_epochs=2),
        wandb_config=wandb_config,
    )
    resumed.train(resume_from_checkpoint=checkpoint, checkpoint_dir=tmp_path / "ckpt")
    assert wandb.run.id == run_id
