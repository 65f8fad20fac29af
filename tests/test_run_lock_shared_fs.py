"""The run lock across hosts: where `flock` is node-local (Lustre `localflock`) or absent (NFS `nolock`), a lease with
a heartbeat in `.comlrl_trl.lease` keeps a second run out, and `acquire` keeps the staging directories a live rank
of a crashed run may still write (issue 58, item 9)."""

import errno
import json
import multiprocessing
import os
import socket
import time

import pytest

from comlrl_trl import checkpoint
from comlrl_trl.checkpoint import LEASE_NAME, RunLock


def _lease(root, host, heartbeat_age, pid=4242):
    """A lease as another run writes it, its last heartbeat `heartbeat_age` seconds ago."""
    now = time.time()
    lease = {"host": host, "pid": pid, "token": "f" * 32, "started": now - 1000, "heartbeat": now - heartbeat_age}
    (root / LEASE_NAME).write_text(json.dumps(lease))


def _no_flock(fd, operation):
    raise OSError(errno.ENOLCK, "No locks available")


@pytest.fixture
def without_flock(monkeypatch):
    """NFS mounted nolock: every flock fails with ENOLCK (warned about once per process)."""
    monkeypatch.setattr(checkpoint.fcntl, "flock", _no_flock)
    monkeypatch.setattr(checkpoint, "_warned_no_flock", True)


def test_a_fresh_lease_of_another_host_refuses_although_the_flock_is_free(tmp_path):
    """Lustre localflock: the other node's flock is invisible here, so this host gets the flock; its lease refuses."""
    _lease(tmp_path, "node-7", heartbeat_age=5)
    lock = RunLock(expiry_s=60)
    with pytest.raises(RuntimeError, match="in use by another live training run") as raised:
        lock.acquire(str(tmp_path))
    message = str(raised.value)
    assert "pid 4242 on host node-7" in message and "heartbeat 5 s ago" in message
    assert "use another output_dir / checkpoint_dir" in message
    assert not lock.held
    assert json.loads((tmp_path / LEASE_NAME).read_text())["host"] == "node-7"  # its lease untouched
    again = RunLock()  # and this run dropped the flock it took on the way
    with pytest.raises(RuntimeError, match="node-7"):
        again.acquire(str(tmp_path))


def test_a_stale_lease_of_another_host_is_taken_over_with_a_warning(tmp_path):
    _lease(tmp_path, "node-7", heartbeat_age=61)
    lock = RunLock(heartbeat_s=5, expiry_s=60)
    with pytest.warns(UserWarning, match="from pid 4242 on host node-7: its last heartbeat was 61 s ago"):
        lock.acquire(str(tmp_path))
    try:
        lease = json.loads((tmp_path / LEASE_NAME).read_text())
        assert (lease["host"], lease["pid"]) == (socket.gethostname(), os.getpid())
    finally:
        lock.release()
    assert not (tmp_path / LEASE_NAME).exists() and not (tmp_path / ".comlrl_trl.lock").exists()


def test_a_dead_runs_lease_on_this_host_never_blocks(tmp_path):
    """With the flock free on this host, its holder is dead, however fresh the heartbeat: taken over silently."""
    _lease(tmp_path, socket.gethostname(), heartbeat_age=0, pid=os.getpid())
    lock = RunLock()
    lock.acquire(str(tmp_path))
    assert json.loads((tmp_path / LEASE_NAME).read_text())["token"] != "f" * 32
    lock.release()


def test_without_flock_the_lease_alone_refuses_a_second_run(tmp_path, without_flock):
    first = RunLock()
    first.acquire(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            RunLock().acquire(str(tmp_path))
    finally:
        first.release()
    second = RunLock()
    second.acquire(str(tmp_path))  # released: free again
    second.release()
    assert os.listdir(tmp_path) == []


def test_without_flock_a_dead_pid_on_this_host_is_taken_over(tmp_path, without_flock):
    dead = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    _lease(tmp_path, socket.gethostname(), heartbeat_age=0, pid=dead.pid)
    lock = RunLock()
    lock.acquire(str(tmp_path))
    assert json.loads((tmp_path / LEASE_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def _race(root, start, results):
    checkpoint.fcntl.flock = _no_flock  # this child only
    checkpoint._warned_no_flock = True
    lock = RunLock()
    start.wait()
    try:
        lock.acquire(root)
    except RuntimeError as error:
        results.put(("refused", str(error)))
        return
    results.put(("won", None))
    time.sleep(1.5)  # hold it while the other finishes trying
    lock.release()


def test_of_two_runs_racing_for_the_lease_exactly_one_wins(tmp_path):
    context = multiprocessing.get_context("fork")
    for attempt in range(5):
        root = str(tmp_path / f"run{attempt}")
        os.makedirs(root)
        start, results = context.Barrier(2), context.Queue()
        racers = [context.Process(target=_race, args=(root, start, results)) for _ in range(2)]
        for racer in racers:
            racer.start()
        outcomes = sorted(results.get(timeout=30) for _ in racers)
        for racer in racers:
            racer.join(timeout=30)
            racer.close()
        results.close()
        results.join_thread()
        assert [verdict for verdict, _ in outcomes] == ["refused", "won"], outcomes
        assert "in use by another live training run" in outcomes[0][1]


def test_the_heartbeat_is_refreshed_while_the_lock_is_held_and_stops_at_release(tmp_path, monkeypatch):
    lock = RunLock(heartbeat_s=0.1, expiry_s=1)
    lock.acquire(str(tmp_path))
    path = tmp_path / LEASE_NAME
    first = json.loads(path.read_text())
    time.sleep(1.3)  # past the expiry: only the heartbeat keeps the lease live
    later = json.loads(path.read_text())
    assert later["heartbeat"] > first["heartbeat"] + 0.8
    assert (later["token"], later["started"]) == (first["token"], first["started"])
    # a run on another node (Lustre localflock: its flock succeeds there) is refused by the refreshed lease
    monkeypatch.setattr(checkpoint.fcntl, "flock", lambda fd, operation: None)
    monkeypatch.setattr(checkpoint.socket, "gethostname", lambda: "another-node")
    with pytest.raises(RuntimeError, match="heartbeat 0 s ago"):
        RunLock(heartbeat_s=0.1, expiry_s=1).acquire(str(tmp_path))
    monkeypatch.undo()
    thread = lock._thread
    lock.release()
    assert not thread.is_alive() and not path.exists()


def test_heartbeat_settings_are_checked():
    with pytest.raises(ValueError, match="heartbeat_s < expiry_s"):
        RunLock(heartbeat_s=60, expiry_s=60)


def test_a_live_ranks_staging_directory_is_kept_and_an_old_orphan_removed(tmp_path):
    """A crashed run on another node whose lease went stale: a rank of it may still write its staging directory."""
    live = tmp_path / ".checkpoint-3.0123456789abcdef.partial" / "agent_1"
    live.mkdir(parents=True)
    (live / "model.safetensors").write_bytes(b"being written")
    orphan = tmp_path / ".checkpoint-2.fedcba9876543210.partial"
    (orphan / "agent_0").mkdir(parents=True)
    old = time.time() - 120
    for path in (orphan / "agent_0", orphan):
        os.utime(path, (old, old))
    _lease(tmp_path, "node-7", heartbeat_age=90)
    lock = RunLock(expiry_s=60)
    with pytest.warns(UserWarning, match="Taking over"):
        lock.acquire(str(tmp_path))
    lock.release()
    assert (live / "model.safetensors").read_bytes() == b"being written"
    assert not orphan.exists()


def test_staging_directories_of_a_dead_holder_on_this_host_and_this_runs_own_are_handled(tmp_path):
    """Flock free on this host: the holder is dead, its staging directories go at once; this run's own stay."""
    dead = tmp_path / ".checkpoint-2.0123456789abcdef.partial"
    own = tmp_path / ".checkpoint-1.00000000000000aa.partial"
    dead.mkdir()
    own.mkdir()
    _lease(tmp_path, socket.gethostname(), heartbeat_age=0)
    lock = RunLock()
    lock.acquire(str(tmp_path), keep_token="00000000000000aa")
    lock.release()
    assert not dead.exists() and own.exists()


def test_without_hard_links_the_lease_is_created_exclusively_all_the_same(tmp_path, without_flock, monkeypatch):
    """Some FUSE mounts refuse os.link: the lease falls back to an exclusive create instead of failing the run."""

    def no_link(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(checkpoint.os, "link", no_link)
    first = RunLock()
    first.acquire(str(tmp_path))
    try:
        assert json.loads((tmp_path / LEASE_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RuntimeError, match="in use by another live training run"):
            RunLock().acquire(str(tmp_path))
    finally:
        first.release()
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore:The run lease")
def test_a_holder_whose_lease_was_taken_over_stops_beating_and_leaves_the_new_lease(tmp_path):
    """A holder late by more than the expiry lost its lease: its heartbeat must not overwrite the new holder's."""
    lock = RunLock(heartbeat_s=0.05, expiry_s=1)
    lock.acquire(str(tmp_path))
    _lease(tmp_path, "node-7", heartbeat_age=0)  # as a run on another node writes it after taking over
    time.sleep(0.5)
    assert json.loads((tmp_path / LEASE_NAME).read_text())["host"] == "node-7"
    assert not lock._thread.is_alive()
    lock.release()
    assert (tmp_path / LEASE_NAME).exists()  # release removes only this run's own lease
