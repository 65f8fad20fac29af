"""Freed CPU memory kept for reuse (glibc's mallopt): fewer page faults, and the trainer asks for it only when told."""

import subprocess
import sys
import textwrap

import pytest


_FAULTS = textwrap.dedent(
    """
    import resource, sys
    import torch
    from comlrl_trl.fast.memory import keep_freed_cpu_memory
    if sys.argv[1] == "keep":
        assert keep_freed_cpu_memory() is True
    def faults_of_allocation():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(16 * 2**20)  # 64 MB
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for _ in range(16):  # the first allocations grow the heap and walk once through its fresh 256 MB top pad
        faults_of_allocation()
    print(faults_of_allocation())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_reused_without_page_faults():
    def faults(mode):
        result = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
        return int(result.stdout.split()[-1])

    # 64 MB is 16384 pages of 4 KB: glibc maps it afresh at every allocation and the kernel faults every page in;
    # kept memory is the same pages again, once the heap's top pad (M_TOP_PAD, 256 MB) has been touched: until then
    # an allocation may take fresh pages from it instead of the block just freed (how many depends on where small
    # allocations fell, 1 to 8 of 64 MB here).
    assert faults("default") > 10_000
    assert faults("keep") < 1_000


def test_trainer_keeps_freed_memory_on_cpu_unless_told_not_to(make_team, monkeypatch):
    import comlrl_trl.trainers.team.trainer as team_trainer

    calls = []
    monkeypatch.setattr(team_trainer, "keep_freed_cpu_memory", lambda: calls.append(1))
    for keep in (True, False):
        make_team(keep_freed_cpu_memory=keep)
    assert calls == [1]
    make_team()  # off by default: a process-wide setting is asked for, never implied
    assert calls == [1]
