"""Two processes on the CPU (gloo DDP) through torchrun: both agents are DDP-wrapped and stay in sync."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comlrl_trl.testing import tiny_model_path


def run_torchrun(script: str, tmp_path, processes: int, *args: str, zero_stage: str | None = None) -> dict:
    """Run `tests/scripts/<script>` under torchrun and return the JSON of its `RESULT ` line."""
    tiny_model_path("qwen2")  # built here, once: ranks building it concurrently under torchrun saved no weights
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    if zero_stage is not None:
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=zero_stage)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        str(Path(__file__).parent / "scripts" / script),
        str(tmp_path),
        *args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_two_process_ddp_trains_both_agents_in_sync(tmp_path):
    report = run_torchrun("ddp_smoke.py", tmp_path, 2)
    assert report["world"] == 2 and report["dist"] == "DistributedType.MULTI_CPU"
    assert report["wrapped"] == ["DistributedDataParallel", "DistributedDataParallel"]
    rank0, rank1 = report["after"]
    assert rank0 == rank1  # gradients were all-reduced for every agent
    assert all(after != before for after, before in zip(rank0, report["before"]))
    rank0_items, rank1_items = report["scored"]
    assert sorted(rank0_items + rank1_items) == list(range(8))  # every item's joint reward computed exactly once
    assert set(rank0_items).isdisjoint(rank1_items)
    assert report["env_step"] == 8 * 4  # 8 items split over 2 ranks, each item scored on 4 joint actions
    assert set(report["eval"]) == {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}
    rank0_eval, rank1_eval = report["evaluated"]
    assert [item for item, _ in rank0_eval] == [0, 2] and [item for item, _ in rank1_eval] == [1, 2]
    real = [reward for _, reward in rank0_eval] + [rank1_eval[0][1]]  # rank 1's second call is the padding
    assert report["eval"]["eval/turn_1/reward_mean"] == pytest.approx(sum(real) / 3)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize("stage", ["2", "3"])
@pytest.mark.parametrize("lora", [False, True])
def test_deepspeed_zero_single_process(tmp_path, stage, lora):
    """One DeepSpeed engine per agent in one process: the second Accelerator must not take a plugin."""
    report = run_torchrun("deepspeed_smoke.py", tmp_path, 1, *(["lora"] if lora else []), zero_stage=stage)
    assert report["engines"] == ["DeepSpeedEngine", "DeepSpeedEngine"]
    assert report["engine_steps"] == [4, 4] and report["steps"] == 4
    for norms in report["grad_norms"]:
        assert len(norms) == 4 and all(0 < n < float("inf") for n in norms)


def test_two_process_actor_critic_keeps_actors_and_critics_in_sync(tmp_path):
    """Critic gradients are averaged over processes like the actors' (DDP), so every rank holds the same critic."""
    report = run_torchrun("ac_ddp_smoke.py", tmp_path, 2)
    assert report["world"] == 2
    for name, modules in (("iac-shared", 2), ("iac-separate", 4), ("maac", 3)):
        run = report[name]
        rank0, rank1 = run["after"]
        assert len(rank0) == modules and rank0 == rank1, name
        assert all(b != a for b, a in zip(run["before"], rank0)), name  # every actor and critic trained
        assert run["env_step"] == 8 and run["steps"] == 2, name


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize(("stage", "precision"), [("2", "fp32"), ("3", "fp32"), ("3", "bf16")])
def test_deepspeed_zero_actor_critic(tmp_path, stage, precision):
    """Value heads inside the agents' DeepSpeed engines (IAC) and a critic in an engine of its own (MAAC) train
    under ZeRO. With bf16 under ZeRO-3 (as on the H200, 2026-12-04) an fp32 head beside the bf16 partitioned
    backbone stopped DeepSpeed's optimiser at construction (one dtype per partition)."""
    report = run_torchrun("ac_deepspeed_smoke.py", tmp_path, 1, precision, zero_stage=stage)
    if precision == "bf16":  # IAC with LoRA agents and heads too
        assert report["lora_steps"] == 2 and len(report["lora_heads"]) == 2
        assert all(weight > 0 for weight in report["lora_heads"])
    assert report["engines"] == ["DeepSpeedEngine"] * 4 and report["steps"] == [2, 2]
    assert report["critic_engines"] == ["DeepSpeedEngine"]
    assert len(report["heads"]) == 3 and all(weight > 0 for weight in report["heads"])
    assert report["value_losses"] == [2, 2]


def test_each_process_trains_on_the_advantages_of_its_own_rewards(tmp_path):
    """raw advantages, no normalisation: each rank's advantages equal the rewards its own items got (worked out
    here from the script's reward 10 * item + k), not another rank's slice of the gathered advantages."""
    report = run_torchrun("advantages_per_process.py", tmp_path, 2)
    assert report["world"] == 2
    for rank, seen in enumerate(report["ranks"]):
        own = [10.0 * rank + 0, 10.0 * rank + 1, 10.0 * (rank + 2) + 0, 10.0 * (rank + 2) + 1]  # items rank, rank+2
        assert seen["rewards"] == own, rank
        assert seen["advantages"] == [own, own], rank  # both agents, align mode: the joint return of each row


def test_two_process_checkpoints_share_one_staging_directory_and_verify_on_resume(tmp_path):
    report = run_torchrun("checkpoint_ddp.py", tmp_path, 2)
    assert report["steps"] == [4, 4]  # one item per rank per step: 2 steps per epoch, 2 epochs (the second resumed)
    assert {"rng_state_0.pth", "rng_state_1.pth", "agent_0/optimizer.pt", "agent_1/model.safetensors"} <= set(
        report["files"]
    )
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-1", "checkpoint-2"]  # no staging, no lock left
    files = len(report["files"])
    # checkpoint-1 verified on resume and checkpoint-2 hashed when saved: both ranks read a share of each
    rank0_hashed, rank1_hashed = report["hashed"]
    assert rank0_hashed + rank1_hashed == 2 * files and rank0_hashed > 0 and rank1_hashed > 0
    rank0_error, rank1_error = report["errors"]  # checkpoint-1 damaged: both ranks stop with rank 0's verdict
    assert rank0_error == rank1_error and "agent_1/model.safetensors is damaged" in rank0_error


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize("stage", ["2", "3"])
def test_deepspeed_marlhf_trains_the_reward_model_with_its_own_engine(tmp_path, stage):
    """The reward-model stage builds a second trainer beside the agents' engines: Accelerate refuses a second
    DeepSpeed plugin, so it runs on the active one, swapped to the reward config's own (its batch size, 3)."""
    report = run_torchrun("marlhf_deepspeed.py", tmp_path, 1, zero_stage=stage)
    assert report["engines"] == ["DeepSpeedEngine", "DeepSpeedEngine"] and report["engine_steps"] == [4, 4]
    assert report["reward_engines"] == [["DeepSpeedEngine", 3]]
    assert len(report["reward_loss"]) == 1 and 0 < report["reward_loss"][0] < 10
    # after the RL stage: the two agents' optimisers hold state; the reward model's moments are gone (under ZeRO-3
    # its weights stay partitioned and score through an engine without an optimiser)
    assert report["memory"][0][0] == 2
    # the reward model scores as it did right after training, through what MARLHF scores with, and its training
    # engine's optimiser is gone under ZeRO-3 too (with its fp32 master and gradient partitions and, at DeepSpeed's
    # default bucket size, a 2 GB reduce bucket)
    assert report["scores"] == report["trained_scores"] and len(report["scores"]) == 1
    assert report["training_optimizer_alive"] == [False]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize("stage", ["2", pytest.param("3", marks=pytest.mark.slow)])
def test_deepspeed_marlhf_iter_rebuilds_engines_and_keeps_memory_flat(tmp_path, stage):
    """Two iterations = two train() calls per agent: every agent's engine is rebuilt (agent 0's was destroyed by
    free_memory() and reused), and no optimiser state of an earlier stage or reward model stays alive."""
    report = run_torchrun("marlhf_deepspeed.py", tmp_path, 1, "iter", zero_stage=stage)
    assert report["engines"] == ["DeepSpeedEngine", "DeepSpeedEngine"] and report["engine_steps"] == [4, 4]
    assert report["reward_engines"] == [["DeepSpeedEngine", 3]] * 2
    first, second = report["memory"]
    assert first == second  # flat across iterations
    # the two agents' optimisers; the reward model's optimiser goes after it trains (under ZeRO-3 its partitioned
    # weights score through an engine without one, until the next reward model is built)
    assert first[0] == 2
    assert report["scores"] == report["trained_scores"] and len(report["scores"]) == 2
    assert report["training_optimizer_alive"] == [False, False]


def test_madpo_process_with_only_ties_joins_every_collective(tmp_path):
    """Rank 1's candidates all tie, so it has no preference pair: it still runs the forwards, gathers and gradient
    all-reduce (a zero-weight placeholder pair). Skipping them hung rank 0; here both finish with equal weights."""
    report = run_torchrun("madpo_ties.py", tmp_path, 2)
    assert report["steps"] == 2 and report["pairs"] == [2.0, 2.0]  # the 2 pairs of rank 0's item, none on rank 1
    assert report["same"] and report["moved"]
    assert all(0 < loss < 10 for loss in report["losses"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
def test_two_zero3_ranks_build_the_tiny_model_into_an_empty_cache(tmp_path, monkeypatch):
    """Both ranks get the whole model: as many parameters as the tiny Qwen2 built by one process (the seed changes
    the weights, not the shapes)."""
    from transformers import AutoModelForCausalLM

    expected = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_path("qwen2")).parameters())
    monkeypatch.setenv("COMLRL_TRL_CACHE", str(tmp_path / "cache"))
    report = run_torchrun("tiny_model_ranks.py", tmp_path, 2, zero_stage="3")
    for files, parameters in report["ranks"]:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
        assert parameters == expected


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
def test_madpo_uneven_pairs_on_two_zero3_ranks(tmp_path):
    """Rank 0 keeps every pair of its item (6 pairs, 12 rows: 3 no-grad chunks of 4 rows), rank 1 only ties (one
    placeholder pair, 1 chunk). ZeRO-3 gathers the parameters in every forward, so rank 1 pads its no-grad pass to
    3 forwards; before, DeepSpeed stopped with "Detected a disagreement on list length between rank0 and rank1"."""
    report = run_torchrun("madpo_ties.py", tmp_path, 2, "all", zero_stage="3")
    assert report["steps"] == 2 and report["pairs"] == [6.0, 6.0]  # C(4, 2) pairs of rank 0's item, per step
    assert report["same"] and report["moved"]
    assert all(0 < loss < 10 for loss in report["losses"])


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
def test_zero3_value_head_with_a_hidden_layer_saves_and_restores(tmp_path):
    """ZeRO-3 partitions the actors' value heads (empty local tensors): the export holds the full trained head, and
    restoring it gathers the parameters first (a plain load_state_dict met [0]-shaped tensors and failed)."""
    report = run_torchrun("value_head_zero3.py", tmp_path, 1, zero_stage="3")
    assert report["partitioned"] == [True, True] and report["nonzero"] == [True, True]
    assert report["shapes"] == {
        "net.0.weight": [32, 32],
        "net.0.bias": [32],
        "net.2.weight": [1, 32],
        "net.2.bias": [1],
    }
    assert report["saved"] == [True, True] and report["restored"] == [True, True]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize("stage", ["2", pytest.param("3", marks=pytest.mark.slow)])
def test_deepspeed_madpo_single_process(tmp_path, stage):
    """MADPO's pair forwards (no-grad log-ratios, then the loss) inside the agents' DeepSpeed engines."""
    report = run_torchrun("madpo_ties.py", tmp_path, 1, zero_stage=stage)
    assert report["steps"] == 4 and report["pairs"] == [2.0] * 4 and report["moved"]
    assert all(0 < loss < 10 for loss in report["losses"])


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize(
    "stage, algorithm",
    [
        ("2", "magrpo"),
        ("3", "magrpo"),
        pytest.param("2", "maac", marks=pytest.mark.slow),
        pytest.param("3", "maac", marks=pytest.mark.slow),
        pytest.param("3", "iac", marks=pytest.mark.slow),
    ],
)
def test_deepspeed_resume_is_exact_for_every_agent_critic_and_head(tmp_path, stage, algorithm):
    """Resuming from checkpoint-1 under ZeRO-2/3 ends with the weights of the uninterrupted run: agent 0's engine
    state is read from checkpoint-N/agent_0 (Trainer looked in checkpoint-N and refused), heads and the critics'
    engines (weights and optimiser state, from checkpoint-N/critic_engine) are restored (Trainer skips
    _load_from_checkpoint under DeepSpeed), and the model fingerprints are taken before DeepSpeed changes the tensors
    (ZeRO-3's empty partitions made the checkpoint look foreign)."""
    full = run_torchrun("deepspeed_resume.py", tmp_path, 1, "full", algorithm, zero_stage=stage)
    resumed = run_torchrun("deepspeed_resume.py", tmp_path, 1, "resume", algorithm, zero_stage=stage)
    assert full["engines"] == resumed["engines"] == ["DeepSpeedEngine", "DeepSpeedEngine"]
    assert resumed["steps"] == full["steps"]
    assert len(full["weights"]) == (3 if algorithm == "maac" else 2)  # the agents (with their heads), the critic
    assert resumed["weights"] == full["weights"]
    if algorithm == "maac":  # the critic's own engine wrote its checkpoint (weights, ZeRO's optimiser partitions)
        assert os.path.isdir(tmp_path / "ckpt" / "checkpoint-1" / "critic_engine" / "state")


# Optimiser steps of each family's run in two_rank_zero.py: 8 items, 4 per rank. MAGRPO: 4 completions per step =
# 2 items (K=2); IAC/MAAC: 2 items per step; MADPO: 4 candidates per step = 1 item; MARLHF(Iter): 1 item per step
# of each RL stage (K=2, 2 completions per step).
TWO_RANK_STEPS = {
    "magrpo": 2,
    "magrpo_lora": 2,
    "magrpo_multi_turn": 2,
    "iac": 2,
    "maac": 2,
    "madpo": 4,
    "marlhf": 4,
    "marlhf_iter": 4,
}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize("stage", ["2", "3"])
@pytest.mark.parametrize("family", list(TWO_RANK_STEPS))
def test_every_family_on_two_zero_ranks_with_uneven_work(tmp_path, stage, family):
    """Two ranks under ZeRO-2/3 with uneven work (rank 1's rewards all tie, MADPO and MARLHF pairs only on rank 0,
    sampled lengths per rank, a second turn): the run finishes, every agent (with its value head) and critic
    trained, and both ranks hold byte-identical weights (SHA-256 of the gathered parameters)."""
    report = run_torchrun("two_rank_zero.py", tmp_path, 2, family, zero_stage=stage)
    assert report["world"] == 2 and report["engines"] == ["DeepSpeedEngine", "DeepSpeedEngine"]
    rank0, rank1 = report["after"]
    assert len(rank0) == {"iac": 4, "maac": 3}.get(family, 2)  # agents, then separate critics or the joint one
    assert rank0 == rank1
    assert all(after != before for after, before in zip(rank0, report["before"]))
    assert report["steps"] == TWO_RANK_STEPS[family]
    if family == "madpo":  # C(4, 2) pairs of rank 0's item per step, none on rank 1
        assert report["pairs"] == [6.0] * 4
    if family == "magrpo_lora":  # the adapters trained (the hashes above changed); the base stayed as loaded
        assert report["frozen"]["after"] == report["frozen"]["before"]
        assert all(0 < trainable < 10_000 for trainable in report["trainable"])
    critics = report["critic_engines"]  # the critics (which trained: their hashes changed) in engines of their own
    assert [critic["engine"] for critic in critics] == ["DeepSpeedEngine"] * {"iac": 2, "maac": 1}.get(family, 0)
    for critic in critics:  # ZeRO-3 partitions the critic's weights over the two ranks; ZeRO-2 keeps them whole
        assert critic["partitioned"] == (stage == "3")
        assert critic["local"] < critic["full"] * 0.6 if stage == "3" else critic["local"] == critic["full"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
@pytest.mark.parametrize("stage", ["2", "3"])
@pytest.mark.parametrize("family", ["resume", "resume_maac"])
def test_two_zero_ranks_resume_to_the_weights_of_the_uninterrupted_run(tmp_path, stage, family):
    """MAGRPO (`resume`) or MAAC (`resume_maac`, its critic in an engine of its own) on two ZeRO ranks, 2 epochs with
    a checkpoint per epoch; resuming from checkpoint-1 ends with the uninterrupted run's weights on both ranks (every
    rank's engine state, its partitions of the critic's engine, and RNG restored)."""
    full = run_torchrun("two_rank_zero.py", tmp_path, 2, family, "full", zero_stage=stage)
    resumed = run_torchrun("two_rank_zero.py", tmp_path, 2, family, "resume", zero_stage=stage)
    assert full["steps"] == resumed["steps"] == 4  # 2 steps per epoch
    assert full["after"][0] == full["after"][1] == resumed["after"][0] == resumed["after"][1]
    assert all(after != before for after, before in zip(full["after"][0], full["before"]))


def test_two_ranks_hash_and_verify_a_checkpoint_each_its_share(tmp_path):
    """Saving and resuming read the files of a checkpoint on every rank, each its share: with a hash slowed to 0.25 s
    per file on one thread, 12 equal files take 6 x 0.25 = 1.5 s on two ranks against 12 x 0.25 = 3 s on rank 0
    alone. A damaged file is found by the rank that reads it, and a rank that raises stops both with its message."""
    rank0, rank1 = run_torchrun("shared_hashing.py", tmp_path, 2)
    assert len(rank0["saved"]) == len(rank1["saved"]) == 6  # equal files: dealt round-robin
    assert sorted(rank0["saved"] + rank1["saved"]) == sorted({*rank0["saved"], *rank1["saved"]})  # each file once
    assert rank0["verified"] == rank0["saved"] and rank1["verified"] == rank1["saved"]  # the same share on resume
    assert rank0["same_manifest"]  # the digests of rank 0 alone
    assert 1.5 <= rank0["shared_time"] < 0.75 * rank0["alone_time"] and rank0["alone_time"] >= 3.0
    damaged = f"{rank1['verified'][0]} is damaged (its sha256 differs"
    assert rank0["damaged"] == rank1["damaged"] and damaged in rank0["damaged"]
    assert rank0["failed"] == rank1["failed"]
    assert rank0["failed"].startswith("RuntimeError: Process 1 of 2 failed while verifying")
    assert "OSError: injected read error on rank 1" in rank0["failed"]
    assert rank0["failed_time"] < 10 and rank1["failed_time"] < 10  # rank 0 hashes its share (1.5 s); ddp_timeout=60


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [None, "2"])
def test_a_checkpoint_of_two_ranks_resumed_by_one_is_refused_at_the_start(tmp_path, zero_stage):
    """Under DDP the global batch and the data position would change, under DeepSpeed the ZeRO shards could not load:
    the resume stops before anything loads, naming both world sizes."""
    saved = run_torchrun("world_size_resume.py", tmp_path, 2, "save", zero_stage=zero_stage)
    assert saved == {"world": 2, "step": 2, "error": None}
    resumed = run_torchrun("world_size_resume.py", tmp_path, 1, "resume", zero_stage=zero_stage)
    assert resumed["world"] == 1 and resumed["step"] == 0
    assert "checkpoint-1: it was saved by a run of 2 processes and this run has 1." in resumed["error"]
    assert ("zero_to_fp32.py" in resumed["error"]) == (zero_stage is not None)


def test_marlhf_scores_each_preference_pair_once_across_two_ranks(tmp_path):
    """The reward model's metrics score the 2P texts of the P gathered pairs once in all, P on each rank (before:
    2P on every rank), and give the metrics of scoring them all on one rank."""
    rank0, rank1 = run_torchrun("marlhf_pair_scoring.py", tmp_path, 2)
    pairs = rank0["pairs"]
    assert pairs == rank1["pairs"] and pairs > 0
    assert rank0["texts"] == rank1["texts"] == pairs  # 2P texts dealt over 2 ranks: P each (an even count)
    assert rank0["logged"] == rank1["logged"]
    for key, value in rank0["alone"].items():
        assert rank0["logged"][key] == pytest.approx(value, abs=1e-6), key


def test_ddp_timeout_bounds_how_long_a_rank_waits_for_a_stalled_one(tmp_path):
    """ddp_timeout is the process group's timeout, also under use_cpu (gloo): with ddp_timeout=3, rank 0 gives up on
    a rank whose read stalls for 12 s after about 3 s (before, gloo's default of 1800 s had it wait out the stall)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    script = str(Path(__file__).parent / "scripts" / "hash_timeout.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script]
    result = subprocess.run([*command, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    reports = [json.loads(line[len("RESULT ") :]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    rank0 = next((report for report in reports if report["rank"] == 0), None)
    assert rank0 is not None, result.stderr[-3000:]
    assert rank0["error"] is not None and 2.5 < rank0["seconds"] < 9, rank0
