"""CPU proofs of scale (issue 58): bytes per rank of fully fine-tuned agents under DDP, ZeRO-2 and ZeRO-3 against a
formula; "2 nodes x 2 ranks" (two torchrun launchers on one machine, gloo) saving, resuming and refusing another
world size, and a rank that fails or stalls mid-step stopping every rank within `ddp_timeout`, for every family."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comlrl_trl.testing import tiny_model_path


SCRIPTS = Path(__file__).parent / "scripts"
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)"
)


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1", **extra}


def _results(stdout: str) -> list[dict]:
    return [json.loads(line[len("RESULT ") :]) for line in stdout.splitlines() if line.startswith("RESULT ")]


# ----- (a) bytes per rank -----

# The tiny Qwen2 (comlrl_trl.testing, tied embeddings): 35,104 parameters, counted by hand in test_lora_base_memory.py.
P = 35_104
N = 2  # agents
W = 2  # processes
FP32 = 4
HIDDEN = 32

# The recipes' DeepSpeed configs, whose bucket sizes transformers fills from the model's hidden size
# (reduce_bucket_size = h^2, stage3_param_persistence_threshold = 10 h): without one (Accelerate's plugin from the
# environment alone), DeepSpeed's defaults apply (see test_zero3_default_buckets_hold_500m_elements_per_agent).
RECIPE_CONFIGS = Path(__file__).parents[1] / "recipes" / "accelerate"


def count_bytes(tmp_path, stage: str | None, auto_buckets: bool = True, family: str = "magrpo") -> dict:
    tiny_model_path("qwen2")  # built here, once
    env = _env()
    if stage is not None:
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=stage)
        if auto_buckets:
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(RECIPE_CONFIGS / f"deepspeed_zero{stage}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(W)]
    command += [str(SCRIPTS / "agent_memory_ranks.py"), str(tmp_path / "out"), str(N), family]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (report,) = _results(result.stdout)
    assert report["world"] == W and all(rank["numel"] == [P] * N for rank in report["ranks"])
    rank0, rank1 = report["ranks"]
    assert (
        rank0["after"] == rank1["after"] and rank0["critic_after"] == rank1["critic_after"]
    )  # the same on every rank
    if stage is None:  # DeepSpeed's bucket use at the peak may differ by a few hundred bytes between ranks
        assert rank0["peak"] == rank1["peak"] and rank0["critic_peak"] == rank1["critic_peak"]
    assert rank0["hooks"] >= 2 * N  # 2 optimiser steps of every agent counted
    return rank0


def test_ddp_holds_params_grads_and_two_moments_of_every_agent_on_every_rank(tmp_path):
    """DDP, fp32 AdamW: every rank holds N x (P params + P grads + 2P moments) x 4 bytes = 16 N P."""
    counted = count_bytes(tmp_path, None)
    assert counted["peak"] == {
        "params": N * P * FP32,
        "grads": N * P * FP32,
        "optimizer": 2 * N * P * FP32,
        "total": 16 * N * P,  # 1,123,328 bytes
    }
    assert counted["after"]["grads"] == 0  # set to None after each step


@pytest.mark.slow
@needs_deepspeed
def test_zero2_partitions_optimizer_state_and_gradients_not_parameters(tmp_path):
    """ZeRO-2, fp32: whole parameters (one flat buffer per agent, 4 N P); over the ranks the fp32 master partition
    (a copy, in fp32 too) and two moments (12 N P / W) and the gradient partitions (4 N P / W): 4 N P + 16 N P / W
    in all (842,496 bytes), plus DeepSpeed's gradient buffers; less than DDP's 16 N P."""
    counted = count_bytes(tmp_path, "2")
    after, peak = counted["after"], counted["peak"]
    assert after["params"] == N * P * FP32
    assert 12 * N * P / W <= after["optimizer"] <= 1.01 * 12 * N * P / W
    assert FP32 * N * P / W <= peak["grads"] < N * P * FP32  # partitions, less than DDP's whole gradients
    assert 4 * N * P + 16 * N * P / W <= peak["total"] < 16 * N * P


@pytest.mark.slow
@needs_deepspeed
def test_zero3_partitions_parameters_too(tmp_path):
    """ZeRO-3, fp32: parameters, gradients, the fp32 master copy and two moments all over the ranks, 20 N P / W
    (16 N P / W with bf16 parameters and gradients), and at the peak the fp32 gradient of the partition of the agent
    stepping (4 P / W); plus ZeRO's padding, the small parameters it keeps whole (norms and biases, under
    10 x hidden elements) and a reduce bucket of hidden^2 elements per agent."""
    counted = count_bytes(tmp_path, "3")
    after, peak = counted["after"], counted["peak"]
    assert FP32 * N * P / W <= after["params"] <= 1.05 * FP32 * N * P / W
    assert 12 * N * P / W <= after["optimizer"] <= 1.01 * 12 * N * P / W
    assert FP32 * N * P / W <= after["grads"] <= 1.02 * FP32 * N * P / W + N * HIDDEN**2 * FP32
    assert 20 * N * P / W <= after["total"] <= 1.02 * 20 * N * P / W + N * HIDDEN**2 * FP32
    assert peak["total"] <= 1.02 * (20 * N + 4) * P / W + N * HIDDEN**2 * FP32


@pytest.mark.slow
@needs_deepspeed
def test_zero3_default_buckets_hold_500m_elements_per_agent(tmp_path):
    """Without a DeepSpeed config of "auto" bucket sizes (Accelerate's plugin from the environment alone; the recipes'
    configs name one), ZeRO-3 takes DeepSpeed's default reduce_bucket_size of 5e8 elements and allocates it per engine:
    2 GB per agent in fp32 (1 GB in bf16) on every rank, untouched pages on a CPU but reserved memory on a GPU. This
    records DeepSpeed's default; docs/scaling.md says how to avoid it."""
    counted = count_bytes(tmp_path, "3", auto_buckets=False)
    assert counted["after"]["grads"] >= N * 500_000_000 * FP32


# IAC's critic: the tiny Qwen2 and a value head (hidden + 1 bias): 35,137 parameters.
PC = P + HIDDEN + 1


ON_DEEPSPEED = [pytest.mark.slow, needs_deepspeed]


@pytest.mark.parametrize("stage", [None, pytest.param("2", marks=ON_DEEPSPEED), pytest.param("3", marks=ON_DEEPSPEED)])
def test_iac_critics_are_held_as_the_agents_are(tmp_path, stage):
    """IAC with a separate critic per agent, each with its own AdamW (under DeepSpeed an engine of its own): the
    critics' bytes per rank follow the agents' formulas with PC parameters each. DDP: 16 N PC, every critic whole
    on every rank; ZeRO-2: 4 N PC + 16 N PC / W (plus gradient buffers); ZeRO-3: 20 N PC / W, no rank ever holding
    a whole critic's parameters (4 N PC / W, plus the padding and small whole parameters), and at the peak the
    fp32 gradient of the stepping critic's partition."""
    counted = count_bytes(tmp_path, stage, family="iac")
    assert counted["critic_numel"] == [PC] * N
    after, peak = counted["critic_after"], counted["critic_peak"]
    if stage is None:
        assert peak == {
            "params": N * PC * FP32,
            "grads": N * PC * FP32,
            "optimizer": 2 * N * PC * FP32,
            "total": 16 * N * PC,  # 1,124,384 bytes
        }
        assert after["grads"] == 0
        assert counted["peak"]["total"] == 16 * N * P  # the agents' bytes are what they are without critics
    elif stage == "2":
        # whole, the flat buffer padded to a multiple of 2 W elements (DeepSpeed's alignment)
        assert N * PC * FP32 <= after["params"] < N * (PC + 2 * W) * FP32
        assert 12 * N * PC / W <= after["optimizer"] <= 1.01 * 12 * N * PC / W
        assert 4 * N * PC + 16 * N * PC / W <= peak["total"] < 16 * N * PC
    else:
        assert FP32 * N * PC / W <= peak["params"] <= 1.05 * FP32 * N * PC / W
        assert FP32 * N * PC / W <= after["params"] <= 1.05 * FP32 * N * PC / W
        assert 12 * N * PC / W <= after["optimizer"] <= 1.01 * 12 * N * PC / W
        assert 20 * N * PC / W <= after["total"] <= 1.02 * 20 * N * PC / W + N * HIDDEN**2 * FP32
        assert peak["total"] <= 1.02 * (20 * N + 4) * PC / W + N * HIDDEN**2 * FP32


# ----- (b) and (c): 2 "nodes" x 2 ranks -----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(
    tmp_path, mode: str, timeout: float = 300, family: str = "magrpo"
) -> tuple[list[dict], list[str], list[int], float]:
    """Two torchrun launchers, `--nnodes 2 --node_rank 0/1 --nproc_per_node 2`, each in its own working directory
    (tmp_path/node0, node1), sharing tmp_path/shared, training a team of `family`. Returns the ranks' RESULTs (by rank), each launcher's stderr and
    return code, and the wall time until both exited."""
    tiny_model_path("qwen2")
    shared, port = tmp_path / "shared", _free_port()
    shared.mkdir(exist_ok=True)
    processes = []
    start = time.perf_counter()
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir(exist_ok=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
        command += ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
        command += [str(SCRIPTS / "two_node_team.py"), str(shared), mode, family]
        processes.append(
            subprocess.Popen(command, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [process.communicate(timeout=timeout) for process in processes]
    seconds = time.perf_counter() - start
    results = sorted((r for out, _ in outputs for r in _results(out)), key=lambda r: r["rank"])
    return results, [err for _, err in outputs], [process.returncode for process in processes], seconds


def _manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "comlrl_trl_checkpoint.json").read_text())["manifest"]


@pytest.mark.slow
def test_two_nodes_save_once_verify_by_shares_resume_and_refuse_another_world_size(tmp_path):
    """A tiny MAGRPO team on 2 nodes x 2 ranks: the checkpoint is written once into the shared directory (nothing in
    the nodes' own directories), every rank hashes its share of its files (each file once), the 4 ranks resume it
    (verified by shares again) and train on to 2 epochs, and 2 ranks resuming it are refused naming both sizes."""
    saved, errors, codes, _ = two_nodes(tmp_path, "save")
    assert codes == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert [(r["rank"], r["node"], r["local_rank"]) for r in saved] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [r["should_save"] for r in saved] == [True, False, False, False]
    assert all(r["world"] == 4 and r["step"] == 2 and r["error"] is None for r in saved)
    ckpt = tmp_path / "shared" / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["checkpoint-1"]
    assert os.listdir(tmp_path / "node0") == [] and os.listdir(tmp_path / "node1") == []
    files = _manifest(ckpt / "checkpoint-1")
    assert {f"rng_state_{rank}.pth" for rank in range(4)} <= set(files)
    hashed = [path for r in saved for path in r["hashed"]]  # relative to each node's directory: ../shared/ckpt/...
    assert all(r["hashed"] for r in saved)  # every rank read a share
    assert len(hashed) == len(set(hashed)) == len(files)  # each file once

    resumed, errors, codes, _ = two_nodes(tmp_path, "resume")
    assert codes == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert all(r["step"] == 4 and r["error"] is None for r in resumed)  # 2 steps per epoch, 2 epochs
    assert sorted(os.listdir(ckpt)) == ["checkpoint-1", "checkpoint-2"]
    assert all(r["hashed"] for r in resumed)  # checkpoint-1 verified and checkpoint-2 hashed, by shares
    assert sum(len(r["hashed"]) for r in resumed) == len(files) + len(_manifest(ckpt / "checkpoint-2"))

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(SCRIPTS / "two_node_team.py"), str(tmp_path / "shared"), "resume"]
    result = subprocess.run(command, cwd=tmp_path / "node0", env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = _results(result.stdout)
    assert len(refused) == 2 and all(r["step"] == 0 for r in refused)
    for r in refused:
        assert "checkpoint-2: it was saved by a run of 4 processes and this run has 2." in r["error"]


def _written(checkpoints: Path) -> list[str]:
    return sorted(name for name in os.listdir(checkpoints) if name.startswith("checkpoint-"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["iac", "maac", "madpo", "marlhf"])
def test_every_family_saves_once_resumes_and_refuses_another_world_size_on_two_nodes(tmp_path, family):
    """IAC (a separate critic per agent), MAAC, MADPO and MARLHF (pairs, reward model, RL stage) on 2 nodes x 2 ranks,
    as MAGRPO above: one epoch writes its checkpoints once, into the shared directory, every rank hashing a share
    (each file once); the 4 ranks resume the latest and train the second epoch only, without repeating the first
    (twice the steps; the reward function called as often as in one epoch, and never by MARLHF, whose pairs are in the
    checkpoint); 2 ranks resuming it are refused, naming both sizes."""
    checkpoints = tmp_path / "shared" / "ckpt"
    saved, errors, codes, _ = two_nodes(tmp_path, "save", family=family)
    assert codes == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert [(r["rank"], r["node"], r["should_save"]) for r in saved] == [
        (0, 0, True),
        (1, 0, False),
        (2, 1, False),
        (3, 1, False),
    ]
    assert all(r["world"] == 4 and r["error"] is None and r["reward_calls"] > 0 for r in saved)
    steps = saved[0]["step"]
    assert steps > 0 and all(r["step"] == steps for r in saved)
    written = _written(checkpoints)  # MARLHF: after its preference stage and after the RL epoch
    assert written == (["checkpoint-1", "checkpoint-2"] if family == "marlhf" else ["checkpoint-1"])
    assert os.listdir(tmp_path / "node0") == [] and os.listdir(tmp_path / "node1") == []
    hashed = [path for r in saved for path in r["hashed"]]
    assert all(r["hashed"] for r in saved)  # each file read once, by one rank
    assert len(hashed) == len(set(hashed)) == sum(len(_manifest(checkpoints / name)) for name in written)

    resumed, errors, codes, _ = two_nodes(tmp_path, "resume", family=family)
    assert codes == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    calls = 0 if family == "marlhf" else saved[0]["reward_calls"]
    assert all(r["step"] == 2 * steps and r["error"] is None and r["reward_calls"] == calls for r in resumed)
    new = _written(checkpoints)
    assert len(new) == len(written) + 1
    # the resumed checkpoint verified and the new one hashed, by shares, each file read once (MARLHF's RL stage's
    # epoch checkpoint too, hashed when written and verified when resumed, not again as part of MARLHF's)
    assert all(r["hashed"] for r in resumed)
    read = sum(len(r["hashed"]) for r in resumed)
    assert read == len(_manifest(checkpoints / written[-1])) + len(_manifest(checkpoints / new[-1]))

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(SCRIPTS / "two_node_team.py"), str(tmp_path / "shared"), "resume", family]
    result = subprocess.run(command, cwd=tmp_path / "node0", env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = _results(result.stdout)
    latest = _written(checkpoints)[-1]
    assert len(refused) == 2 and all(r["step"] == 0 and r["reward_calls"] == 0 for r in refused)
    for r in refused:
        assert f"{latest}: it was saved by a run of 4 processes and this run has 2." in r["error"]


@pytest.mark.slow
def test_save_on_each_node_across_two_nodes_is_refused_on_every_rank(tmp_path):
    """transformers' save_pretrained writes the weights on global rank 0 only, so node 1's copy under
    save_on_each_node lacked every agent's model.safetensors (and its run id differed): refused before training."""
    results, errors, codes, _ = two_nodes(tmp_path, "each_node_save")
    assert codes == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert len(results) == 4
    for r in results:
        assert r["error"].startswith("save_on_each_node=True on 2 nodes is not supported") and r["step"] == 0
    assert not (tmp_path / "node0" / "ckpt").exists() and not (tmp_path / "node1" / "ckpt").exists()


FAILED = "RuntimeError: injected failure on rank 3 in its second reward call"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "mode", "message"),
    [
        ("magrpo", "fail", FAILED),
        ("magrpo", "stall", "Timed out waiting 10000ms"),
        ("iac", "fail", FAILED),
        ("maac", "fail", FAILED),
        ("madpo", "fail", FAILED),
        ("marlhf", "fail", FAILED),  # in its preference stage, where the reward function scores the candidates
    ],
)
def test_a_rank_failing_or_stalling_mid_step_stops_every_rank(tmp_path, family, mode, message):
    """Rank 3 (node 1) raises in its second reward call (`fail`, ddp_timeout=20), or sleeps 300 s there without an
    error (`stall`, ddp_timeout=10): both launchers exit with an error well before the stall ends, and the failing
    rank's message (or the timeout of the ranks waiting for it) is in the launchers' output."""
    results, errors, codes, seconds = two_nodes(tmp_path, mode, timeout=240, family=family)
    assert codes[0] != 0 and codes[1] != 0
    assert results == []  # no rank finished training
    assert message in errors[0] + errors[1]
    if mode == "fail":
        assert message in errors[1]  # node 1's launcher shows its rank's own error
    assert seconds < 150  # start-up and the first step included; the stall alone would take 300 s
