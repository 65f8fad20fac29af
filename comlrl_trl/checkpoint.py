"""Multi-agent training checkpoints: layout, metadata, compatibility and crash-safe commits.

A checkpoint directory `checkpoint-N/` holds:

- `agent_i/`: agent i's model (or LoRA adapter) and tokenizer, plus its optimizer and scheduler state;
- `trainer_state.json` and `rng_state*.pth`: the team loop's progress, log history and RNG, written by
  transformers' own machinery;
- `comlrl_trl_state.pt`: the team's runtime state (env_step, per-agent trainer state, stateful user objects);
- `comlrl_trl_checkpoint.json`: the metadata (trainer class, sequence, run id, W&B identity, the
  compatibility fingerprint with every setting that changes the result, and the manifest: the size and sha256 of
  every other file), written last: a directory without it is not a checkpoint.

Checkpoints are written into a hidden staging directory, unique to the run, and renamed into place, so a process
killed while saving leaves the previous checkpoints intact and no partial `checkpoint-N`. One live run at a time
may write a checkpoint directory (`RunLock`): it holds an exclusive `flock` on `.comlrl_trl.lock` there for its whole
`train()` (the operating system releases it when the process dies, so a crashed run never blocks the next one on
its host), and a lease in `.comlrl_trl.lease` whose heartbeat a thread refreshes every `LEASE_HEARTBEAT_S` seconds.
The lease is what holds across hosts: on Lustre mounted `localflock` (each node sees only its own flocks) and on NFS
mounted `nolock` (no flock: the run warns once and holds the lease alone), a second run refuses while another
host's lease, or another live process's on the same host, had a heartbeat within `LEASE_EXPIRY_S` seconds, and takes
over an older one with a warning (a run that dies on another node blocks the directory for up to that long). The
same lock on `output_dir` is taken at the first `train()` and held while the trainer lives (`hold_output_dir`), so
that the results written after training (`save_model`, a recipe's `models/` and `metrics.json`) are covered too.
Taking the lock removes the staging directories of dead runs, but keeps those a rank of a crashed run on another
node may still write (changed within `LEASE_EXPIRY_S`). Resuming verifies the manifest and names any missing or
damaged file.

Hashing costs one read of every file (when saving, and on resume). With several processes the files are dealt out
(`hash_shares`: balanced by bytes, the same on every process) and each process hashes its share, so N processes read
about 1/N of the checkpoint each; the main process writes the manifest (or decides the verdict) from the gathered
digests, and an error on any process reaches every process, naming it. Rename and prune stay on the main process.
How long a process waits for the others at these collectives is bounded by the process group's timeout,
transformers' `ddp_timeout` (default 1800 s; `apply_ddp_timeout` sets it where transformers does not, under
`use_cpu`). Each process hashes on up to `HASH_THREADS` threads
(hashlib releases the GIL), each safetensors shard and optimiser file separately. Measured from the page cache on a
shared 2-core machine: 0.5-1.2 GB/s on one thread, 0.9-1.2 GB/s on threads (2 cores). A 200 GB checkpoint (two 7B
agents with optimiser state) then costs about 3-7 minutes on one core; with 8 free cores it is bounded by how fast
the filesystem reads.
"""

import atexit
import concurrent.futures
import contextlib
import datetime
import enum
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator
from typing import Any


try:
    import fcntl
except ImportError:  # not on Windows: no lock there
    fcntl = None


METADATA_NAME = "comlrl_trl_checkpoint.json"
STATE_NAME = "comlrl_trl_state.pt"
CHECKPOINT_VERSION = 1
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def read_checkpoint_metadata(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a checkpoint directory: `version`, `trainer_class`, `sequence`, `run_id`, `wandb`, ...

    `wandb` is the W&B run identity (`id`, and `project`/`entity` when known) or None, so that a resumed run
    can continue the same W&B run::

        identity = read_checkpoint_metadata(path)["wandb"]
        if identity and "id" not in wandb_config and "resume" not in wandb_config:
            wandb_config = {**wandb_config, **identity, "resume": "allow"}
    """
    path = os.path.join(os.fspath(checkpoint), METADATA_NAME)
    if not os.path.exists(os.fspath(checkpoint)):
        parent = os.path.dirname(os.path.abspath(os.fspath(checkpoint)))
        found = [os.path.basename(p) for _, p in list_checkpoints(parent)]
        listing = (
            f"The complete checkpoints in {parent!r} are: {', '.join(found)}; pass one of them, or "
            "resume_from_checkpoint=True for the latest."
            if found
            else f"{parent!r} holds no complete checkpoint."
        )
        raise FileNotFoundError(f"Cannot resume from {os.fspath(checkpoint)!r}: it does not exist. {listing}")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{os.fspath(checkpoint)!r} is not a complete comlrl_trl checkpoint (no {METADATA_NAME}); it may have "
            "been interrupted while saving. Resume from an earlier checkpoint-N directory."
        )
    with open(path) as f:
        metadata = json.load(f)
    if metadata.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"Unsupported checkpoint version {metadata.get('version')!r} in {path}.")
    return metadata


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, str]]:
    """Complete checkpoints under `root`, as `(sequence, path)` sorted by sequence."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, METADATA_NAME)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The complete checkpoint with the highest sequence under `root`, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


LOCK_NAME = ".comlrl_trl.lock"
LEASE_NAME = ".comlrl_trl.lease"
LEASE_HEARTBEAT_S = 10.0  # how often a holder refreshes its lease
LEASE_EXPIRY_S = 60.0  # a lease without a heartbeat for this long belongs to a dead (or hung) run
_STAGING_RE = re.compile(r"^\.checkpoint-\d+\.[0-9a-f]+\.partial$")

# Settings that change what a run computes. A resumed run must use the checkpoint's values (num_train_epochs and
# max_steps may grow: they only say how long the run is).
RESULT_SETTINGS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_ratio",
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
    "logprob_temperature",
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


def result_settings(args, extra: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values of `RESULT_SETTINGS` (and `extra`, less `exclude`) that `args` has, as JSON would give them back."""
    names = [name for name in (*RESULT_SETTINGS, *extra) if hasattr(args, name) and name not in exclude]
    values = {name: getattr(args, name) for name in names}
    return json.loads(json.dumps(values, default=lambda v: v.value if isinstance(v, enum.Enum) else str(v)))


def staging_dir(root: str, name: str, token: str) -> str:
    """The hidden directory a checkpoint is written into before it is renamed to `root/name`; `token` is unique to
    the run (the same on all of its processes), so two runs never share one."""
    return os.path.join(root, f".{name}.{token}.partial")


def new_staging_token() -> str:
    """A token unique to this run, the same on every process (it names the run's staging directories)."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([uuid.uuid4().hex[:16]])[0]


def _holder() -> str:
    """What a lock file records about its holder: `pid host`."""
    return f"{os.getpid()} {socket.gethostname()}"


def _describe_holder(text: str) -> str:
    """`pid 123 on host node-1` from a lock file's `123 node-1` (an older file holds only the pid)."""
    pid, _, host = text.strip().partition(" ")
    if not pid:
        return "pid unknown"
    return f"pid {pid} on host {host}" if host else f"pid {pid}"


def _in_use(root: str, holder: str, more: str = "") -> RuntimeError:
    return RuntimeError(
        f"{root!r} is in use by another live training run ({holder}{more}): two runs must not write the same "
        "directory (checkpoints, models, metrics). Wait for it to finish, stop it, or use another output_dir / "
        "checkpoint_dir."
    )


def _read_lease(path: str) -> dict[str, Any] | None:
    """The lease in `path`, or None where there is none (no file, or not a lease: a partial or foreign file)."""
    try:
        with open(path) as file:
            lease = json.load(file)
    except (OSError, ValueError):
        return None
    fields = {"host": str, "pid": int, "token": str, "heartbeat": (int, float)}
    if not isinstance(lease, dict) or not all(isinstance(lease.get(k), t) for k, t in fields.items()):
        return None
    return lease


def _write_lease(path: str, lease: dict[str, Any], replace: bool) -> bool:
    """Write `lease` to `path` whole (a temporary file, then one atomic step); False where `replace` is False and
    `path` exists already (`os.link` creates it only where it does not: one of two racing writers gets it)."""
    temp = f"{path}.{lease['token']}.{threading.get_ident()}.tmp"
    try:
        with open(temp, "w") as file:
            json.dump(lease, file)
            file.flush()
            os.fsync(file.fileno())
        if replace:
            os.replace(temp, path)
            return True
        try:
            os.link(temp, path)
        except FileExistsError:  # taken, or (NFS) a retried link that had made it: the file says which
            found = _read_lease(path)
            return found is not None and found["token"] == lease["token"]
        except OSError:  # no hard links on this filesystem: an exclusive create, written in place
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(descriptor, "w") as file:
                json.dump(lease, file)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except (OSError, OverflowError):
        return False
    return True


def _heartbeat(ref: "weakref.ref[RunLock]", stop: threading.Event, path: str, lease: dict[str, Any]) -> None:
    """Refresh `lease` in `path` every `heartbeat_s` seconds of the lock until `stop` is set, or the lock is gone."""
    lease = dict(lease)
    while True:
        lock = ref()
        if lock is None:  # dropped without release (its flock closed with it): clear the lease as release would
            found = _read_lease(path)
            if found is not None and found["token"] == lease["token"]:
                with contextlib.suppress(OSError):
                    os.remove(path)
            return
        interval = lock.heartbeat_s
        del lock
        if stop.wait(interval):
            return
        found = _read_lease(path)
        if found is not None and found["token"] != lease["token"]:  # this run's heartbeat was late past the expiry
            warnings.warn(
                f"The run lease in {path!r} was taken over by {_lease_holder(found)} while this run held it (its "
                "heartbeat was late by more than the expiry): two runs may now write the same directory. Stop one "
                "of them.",
                stacklevel=1,
            )
            return
        lease["heartbeat"] = time.time()
        with contextlib.suppress(OSError):  # a transient error (NFS): the next beat tries again
            _write_lease(path, lease, replace=True)


def _lease_holder(lease: dict[str, Any]) -> str:
    return f"pid {lease['pid']} on host {lease['host']}"


class RunLock:
    """An exclusive lock on a directory (checkpoint_dir, output_dir) for one run: a second live run refuses to start.

    Two locks, one on top of the other:

    - `flock` on `.comlrl_trl.lock` (the holder's pid and host in it, for the error message). `flock` locks belong to
      the open file, so the operating system drops them when the process ends, however it ends: a lock left by a
      killed run never blocks a run on the same host.
    - a lease in `.comlrl_trl.lease` (JSON: holder host, pid, a token of this lock, start and heartbeat times), which
      a daemon thread refreshes every `heartbeat_s` seconds (`LEASE_HEARTBEAT_S`). It is what holds across hosts
      where `flock` does not: Lustre's `localflock` (a flock seen only on its own node) and NFS mounted `nolock`
      (no flock at all). A lease of another host, or of another live pid of this host where there is no flock,
      refuses the run while its heartbeat is younger than `expiry_s` (`LEASE_EXPIRY_S`); an older one was left by a
      run that died, or stopped beating: it is taken over with a warning. Where this process holds the flock, a
      lease of this host is a dead run's (a live one would hold the flock): it is taken over silently. The lease is
      created with `os.link` of a complete temporary file (exclusive: of two racing runs exactly one gets it) and
      refreshed with `os.replace`; a stale one is moved aside with `os.rename`, which one taker does. The hosts'
      clocks must agree to well within `expiry_s`.

    A directory this process already holds as an output_dir (`hold_output_dir`) is not locked a second time. Where
    `flock` fails with anything but "held by another process" (the filesystem has no working lock), the run warns
    once per process and holds the lease alone.

    `acquire` removes the staging directories (`.checkpoint-N.<token>.partial`) of other runs that no live process
    may still be writing: every one where the directory held no lease, or the lease's holder was a dead process
    of this host; where the lease was only old (another host's holder stopped beating), only those in which nothing
    changed for `expiry_s` (a rank of that crashed job on another node may still write the others). `keep_token`
    names this run's own, which are never removed.
    """

    def __init__(self, heartbeat_s: float | None = None, expiry_s: float | None = None):
        self.heartbeat_s = LEASE_HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.expiry_s = LEASE_EXPIRY_S if expiry_s is None else expiry_s
        if not 0 < self.heartbeat_s < self.expiry_s:
            raise ValueError(
                f"RunLock needs 0 < heartbeat_s < expiry_s, got heartbeat_s={self.heartbeat_s} and "
                f"expiry_s={self.expiry_s}: a holder must beat several times within the expiry."
            )
        self._file = None
        self._lease_path = self._token = None
        self._stop = None
        self._thread = None

    @property
    def held(self) -> bool:
        """Whether this lock holds its directory (a flock, a lease, or both)."""
        return self._file is not None or self._lease_path is not None

    def acquire(self, root: str, keep_token: str | None = None) -> None:
        if fcntl is None or self.held:
            return
        os.makedirs(root, exist_ok=True)
        if os.path.realpath(root) in _HELD_FOR_PROCESS:
            live_holder_possible = False  # this process holds it: its staging directories are this run's or dead
        else:
            flocked = self._lock(root)
            try:
                live_holder_possible = self._take_lease(root, flocked)
            except BaseException:
                self._drop_flock(remove=False)
                raise
        self._remove_dead_staging(root, keep_token, live_holder_possible)

    def _lock(self, root: str) -> bool:
        """Take the flock on `root`'s lock file; False where flock does not work."""
        path = os.path.join(root, LOCK_NAME)
        while True:
            file = open(path, "a+")
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = _describe_holder(file.read())
                file.close()
                raise _in_use(root, holder) from None
            except OSError as error:  # no working flock on this filesystem (ENOLCK, EOPNOTSUPP, ...)
                empty = os.fstat(file.fileno()).st_size == 0
                file.close()
                if empty:  # created by this open: leave no lock file that suggests a lock
                    with contextlib.suppress(OSError):
                        os.remove(path)
                _warn_no_flock(root, error)
                return False
            try:
                same = os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            file.close()  # the previous holder removed this file as we locked it: lock the new one
        self._file, self._path = file, path
        return True

    def _take_lease(self, root: str, flocked: bool) -> bool:
        """Write this run's lease into `root`, or raise naming the live holder of the one there. True where the
        lease found may belong to a live process (it was only old), False where there was none or its holder died."""
        path = os.path.join(root, LEASE_NAME)
        host, now = socket.gethostname(), time.time()
        lease = {"host": host, "pid": os.getpid(), "token": uuid.uuid4().hex, "started": now, "heartbeat": now}
        live_holder_possible = False
        for _ in range(8):  # each pass loses one race at most: to a run that then holds the lease, or a taker
            found = _read_lease(path)
            if found is not None:
                age = time.time() - found["heartbeat"]
                if found["host"] == host and (flocked or not _pid_alive(found["pid"])):
                    pass  # its holder is dead: with a flock here, a live one would hold it
                elif age < self.expiry_s:
                    raise _in_use(
                        root,
                        _lease_holder(found),
                        f", lease heartbeat {max(age, 0.0):.0f} s ago, expires after {self.expiry_s:.0f} s without "
                        "one",
                    )
                else:
                    live_holder_possible = True
                    warnings.warn(
                        f"Taking over the run lease in {root!r} from {_lease_holder(found)}: its last heartbeat was "
                        f"{age:.0f} s ago (expiry {self.expiry_s:.0f} s), so that run died or hangs.",
                        stacklevel=4,
                    )
                aside = f"{path}.{lease['token']}.stale"
                try:
                    os.rename(path, aside)
                except FileNotFoundError:
                    continue  # another run moved it first: look again
                moved = _read_lease(aside)
                if moved is not None and moved["token"] != found["token"]:  # a new holder's, written meanwhile
                    with contextlib.suppress(OSError):
                        os.link(aside, path)  # put it back (unless yet another run wrote one): it refuses us next
                with contextlib.suppress(OSError):
                    os.remove(aside)
                if moved is not None and moved["token"] != found["token"]:
                    continue
            if not _write_lease(path, lease, replace=False):
                continue  # another run created it between our read and our write: look again
            written = _read_lease(path)
            if written is None or written["token"] != lease["token"]:
                raise _in_use(root, _lease_holder(written) if written else "another run took the lease as we wrote")
            break
        else:
            raise _in_use(root, "the lease changed hands repeatedly while this run tried to take it")
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(f"{_holder()}\n")
            self._file.flush()
        self._lease_path, self._stop = path, threading.Event()
        self._thread = threading.Thread(
            target=_heartbeat,
            args=(weakref.ref(self), self._stop, path, lease),
            name=f"comlrl_trl-lease-{root}",
            daemon=True,
        )
        self._token = lease["token"]
        self._thread.start()
        return live_holder_possible

    def _remove_dead_staging(self, root: str, keep_token: str | None, live_holder_possible: bool) -> None:
        """Remove the staging directories that no live process may still write (see the class docstring)."""
        for name in os.listdir(root):
            if not _STAGING_RE.match(name) or (keep_token is not None and f".{keep_token}." in name):
                continue
            path = os.path.join(root, name)
            if live_holder_possible and time.time() - _newest_mtime(path) < self.expiry_s:
                continue  # touched within the expiry: a rank of the crashed run may still be writing it
            shutil.rmtree(path, ignore_errors=True)

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            found = _read_lease(self._lease_path)
            if found is not None and found["token"] == self._token:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._lease_path)  # before the flock goes, so no run on this host sees a live lease
            self._lease_path = self._stop = self._thread = None
        self._drop_flock(remove=True)

    def _drop_flock(self, remove: bool) -> None:
        if self._file is not None:
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path)  # while still holding the lock, so no other run holds a removed file
            self._file.close()  # closing drops the flock
            self._file = None


def _newest_mtime(path: str) -> float:
    """The latest modification time of `path` and everything under it."""
    newest = os.lstat(path).st_mtime
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
    return newest


# output_dir (real path) -> its lock, held while a trainer that trains into it lives (at most until the process exits)
_HELD_FOR_PROCESS: dict[str, RunLock] = {}
_OWNERS: dict[str, set[int]] = {}  # output_dir -> the ids of the live trainers holding it
_CLAIMED: set[str] = set()  # every output_dir this process has trained into


def hold_output_dir(output_dir: str, owner: object) -> bool:
    """Lock `output_dir` while `owner` (a trainer) lives; True the first time this process claims the directory.

    Trainers of one process share the lock, one after another. It outlives `train()`, so that a second run cannot
    start between the end of training and the results written after it (`save_model`, a recipe's `models/` and
    `metrics.json`); it is released when the last trainer holding it is garbage-collected, or when the process ends.
    Raises `RuntimeError` naming the pid and host of a live run in another process that holds it.
    """
    key = os.path.realpath(output_dir)
    if key not in _HELD_FOR_PROCESS:
        lock = RunLock()
        lock.acquire(output_dir)
        if not _CLAIMED:
            atexit.register(_release_output_dirs)
        _HELD_FOR_PROCESS[key] = lock
    owners = _OWNERS.setdefault(key, set())
    if id(owner) not in owners:
        owners.add(id(owner))
        weakref.finalize(owner, _drop_owner, key, id(owner))
    first = key not in _CLAIMED
    _CLAIMED.add(key)
    return first


def _drop_owner(key: str, owner: int) -> None:
    owners = _OWNERS.get(key, set())
    owners.discard(owner)
    if not owners and key in _HELD_FOR_PROCESS:
        _OWNERS.pop(key, None)
        _HELD_FOR_PROCESS.pop(key).release()


def _release_output_dirs() -> None:
    """Release every output_dir this process holds and forget them (as when the process ends)."""
    while _HELD_FOR_PROCESS:
        _HELD_FOR_PROCESS.popitem()[1].release()
    _OWNERS.clear()
    _CLAIMED.clear()


# What a finished run leaves in its output_dir: `save_model`'s settings and the recipes' `models/` and report.
RESULT_FILES = ("team_settings.json", "models", "metrics.json")


def earlier_results(output_dir: str) -> list[str]:
    """The results of a run found in `output_dir` (see `RESULT_FILES`), by name."""
    return [name for name in RESULT_FILES if os.path.exists(os.path.join(output_dir, name))]


def refuse_overwriting_results(output_dir: str, found: list[str]) -> None:
    """A new run must not overwrite another run's results (`found` in `output_dir`) without `overwrite_output_dir`."""
    if found:
        raise FileExistsError(
            f"output_dir={output_dir!r} holds the results of an earlier run ({', '.join(found)}), which this run "
            "would overwrite. Use another output_dir, resume that run (resume_from_checkpoint=...), or set "
            "overwrite_output_dir=True (--overwrite_output_dir, or `overwrite_output_dir: true` in YAML) to replace "
            "them."
        )


def apply_ddp_timeout(seconds: float | None) -> None:
    """Make `ddp_timeout` the process group's timeout where transformers did not pass it.

    transformers passes `ddp_timeout` to `init_process_group` on GPUs (DDP and DeepSpeed) but not under `use_cpu`,
    where gloo kept its 30-minute default; this sets it on the default group (a local setting of each process, no
    collective). Nothing happens without a process group. Where this torch cannot set it (torch's private
    `_set_pg_timeout` is missing or fails), a warning says that the waits keep the group's own timeout.
    """
    import torch.distributed as dist

    if seconds is None or not (dist.is_available() and dist.is_initialized()):
        return
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    try:
        if set_timeout is None:
            raise AttributeError("torch.distributed.distributed_c10d has no _set_pg_timeout")
        set_timeout(datetime.timedelta(seconds=seconds))
    except Exception as error:  # a private torch function: any failure leaves the group's timeout
        warnings.warn(
            f"ddp_timeout={seconds} s could not be set on the process group ({type(error).__name__}: {error}); "
            "waits for other processes keep the group's own timeout (gloo's default: 30 minutes). Pass `timeout=` to "
            "`init_process_group` yourself, or use a torch that has `_set_pg_timeout`.",
            stacklevel=2,
        )


def on_main_process(function, accelerator):
    """`function()` on the main process only; every process gets its result, or raises its error (so that no rank
    goes on to wait for a rank that stopped). Without several processes (`accelerator` None or of one), just
    `function()`."""
    if not _distributed(accelerator):
        return function()
    from accelerate.utils import broadcast_object_list

    verdict: list[Any] = [None, None]
    if accelerator.is_main_process:
        try:
            verdict = [function(), None]
        except Exception as error:
            verdict = [None, error]
    result, error = broadcast_object_list(verdict)
    if error is not None:
        raise error
    return result


_warned_no_flock = False


def _warn_no_flock(root: str, error: OSError) -> None:
    global _warned_no_flock
    if _warned_no_flock:
        return
    _warned_no_flock = True
    warnings.warn(
        f"The filesystem of {root!r} has no working flock ({error.strerror or error}): the run holds the directory "
        f"with a lease alone ({LEASE_NAME}, a heartbeat every {LEASE_HEARTBEAT_S:.0f} s), so a run that dies on "
        f"another host blocks the directory for up to {LEASE_EXPIRY_S:.0f} s, and the hosts' clocks must agree to "
        "within a few seconds. A filesystem with locking (a local disk, or NFS mounted with locking) needs neither.",
        stacklevel=4,
    )


def check_output_dir(output_dir) -> None:
    """Refuse an `output_dir` that cannot become a directory: it, or the nearest part of its path that exists, is a
    file."""
    if output_dir is None:
        return
    path = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"is inside {existing!r}, which is a file"
        raise ValueError(
            f"output_dir={os.fspath(output_dir)!r} {where}: output_dir must be a directory (it receives checkpoints, "
            "models and logs). Choose another output_dir, or move the file away."
        )


def check_writable(root: str, what: str) -> None:
    """Fail at the start of training, not at the first save, when `root` cannot be written."""
    try:
        os.makedirs(root, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".comlrl_trl_write_test.", dir=root)
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        raise PermissionError(
            f"{what}={root!r} is not writable ({error.strerror or error}); checkpoints could not be saved. Choose a "
            "writable directory or fix its permissions."
        ) from error


@contextlib.contextmanager
def writing_checkpoint(staging: str, final: str) -> Iterator[None]:
    """Remove the staging directory if saving fails; say "No space left on device" when the disk is full.

    PyTorch reports a full disk as `[enforce fail at inline_container.cc] unexpected pos ...`, a RuntimeError;
    such writer errors are reported with the free space left.
    """
    try:
        yield
    except (OSError, RuntimeError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        root = os.path.dirname(final)
        disk_full = isinstance(error, OSError) and error.errno == errno.ENOSPC
        writer_failed = isinstance(error, RuntimeError) and (
            "unexpected pos" in str(error) or "file write failed" in str(error)
        )
        if not (disk_full or writer_failed):
            raise
        try:
            free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        raise OSError(
            errno.ENOSPC,
            f"No space left on device while saving {os.path.basename(final)} into "
            f"{root!r} ({free}; writer error: {error}). The partial checkpoint was removed; earlier "
            "checkpoints are intact. Free some space (or lower checkpoint_total_limit) and resume.",
        ) from error


MANIFEST_KEY = "manifest"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


HASH_THREADS = 8  # files hashed at once (hashlib releases the GIL: threads read and hash in parallel)
FILE_COST = 1 << 20  # what one file costs beyond its bytes when shares are balanced (open, metadata round trips)


def _sha256_all(paths: list[str]) -> list[str]:
    """The sha256 of every file, on up to `HASH_THREADS` threads, in the order given."""
    if len(paths) <= 1:
        return [_sha256(path) for path in paths]
    with concurrent.futures.ThreadPoolExecutor(min(HASH_THREADS, len(paths))) as pool:
        return list(pool.map(_sha256, paths))


def hash_shares(sizes: list[int], processes: int) -> list[list[int]]:
    """Which files each process hashes, as indices into `sizes`: balanced by bytes, the same on every process.

    The largest file goes first, each to the process with the least work so far (its bytes plus `FILE_COST` per
    file; ties to the lower rank). Equal files are dealt round-robin; no process reads more than the average share
    plus one file.
    """
    loads, shares = [0] * processes, [[] for _ in range(processes)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(processes), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += sizes[index] + FILE_COST
    return [sorted(share) for share in shares]


def _distributed(accelerator) -> bool:
    return accelerator is not None and accelerator.num_processes > 1


def _process(accelerator) -> tuple[int, int]:
    """`(index, count)` of this process among the run's, `(0, 1)` without several processes."""
    return (accelerator.process_index, accelerator.num_processes) if _distributed(accelerator) else (0, 1)


def on_every_process(function, accelerator, what: str) -> list[Any]:
    """`function()` on every process; every process gets the results of all, in rank order, or raises on every process
    the error of the first process that failed (named), so that no rank is left waiting for one that stopped.
    Without several processes, `[function()]` (its error raised as it is)."""
    if not _distributed(accelerator):
        return [function()]
    from accelerate.utils import gather_object

    try:
        outcome = (function(), None)
    except Exception as error:
        outcome = (None, f"{type(error).__name__}: {error}")
    outcomes = gather_object([outcome])
    failed = [(rank, error) for rank, (_, error) in enumerate(outcomes) if error is not None]
    if failed:
        rank, error = failed[0]
        raise RuntimeError(f"Process {rank} of {len(outcomes)} failed while {what}: {error}")
    return [result for result, _ in outcomes]


def hash_files(paths: list[str], sizes: list[int], accelerator=None) -> list[str]:
    """The sha256 of every file of `paths` (the same list on every process), in order.

    With several processes each hashes its share (`hash_shares`) and every process gets all digests; an error on
    any process (an unreadable file) is raised on every process, naming the process.
    """
    rank, processes = _process(accelerator)
    shares = hash_shares(sizes, processes)
    results = on_every_process(
        lambda: _sha256_all([paths[i] for i in shares[rank]]), accelerator, "hashing checkpoint files"
    )
    digests: list[str] = [""] * len(paths)
    for share, share_digests in zip(shares, results):
        for index, digest in zip(share, share_digests):
            digests[index] = digest
    return digests


def _listing(directory: str) -> list[tuple[str, int]]:
    """`(relative path, size)` of every file under `directory` but the metadata, sorted by path."""
    files = []
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            if relative != METADATA_NAME:
                files.append((relative, os.path.getsize(path)))
    return sorted(files)


def nested_manifest(directory: str, relatives: list[str]) -> dict[str, dict[str, Any]]:
    """The manifests of the checkpoints nested in `directory` (a subdirectory with metadata of its own, such as the
    RL stage's epoch checkpoint moved into a MARLHF checkpoint), found among `relatives` (its listing), merged, keyed
    by path relative to `directory`. The nested metadata files themselves are not in it."""
    found = {}
    for relative in relatives:
        prefix, _, name = relative.rpartition("/")
        if not prefix or name != METADATA_NAME:
            continue
        with open(os.path.join(directory, *relative.split("/"))) as f:
            manifest = json.load(f).get(MANIFEST_KEY) or {}
        found.update({f"{prefix}/{nested}": entry for nested, entry in manifest.items()})
    return found


def _listing_and_nested(directory: str) -> tuple[list[tuple[str, int]], dict[str, dict[str, Any]]]:
    files = _listing(directory)
    return files, nested_manifest(directory, [relative for relative, _ in files])


def build_manifest(directory: str, accelerator=None) -> dict[str, dict[str, Any]]:
    """`{relative path: {"size": bytes, "sha256": hex}}` for every file under `directory` but the metadata.

    A file of a nested checkpoint (`nested_manifest`), moved in whole after its own manifest was written, keeps the
    digest recorded there when its size is the same: it is not read again. With an `accelerator` of several
    processes, call it on every process: the main process lists the files, every process hashes its share of the
    others (`hash_files`), and every process gets the whole manifest.
    """
    files, known = on_main_process(lambda: _listing_and_nested(directory), accelerator)  # one walk
    fresh = [(relative, size) for relative, size in files if known.get(relative, {}).get("size") != size]
    paths = [os.path.join(directory, *relative.split("/")) for relative, _ in fresh]
    digests = dict(
        zip((relative for relative, _ in fresh), hash_files(paths, [size for _, size in fresh], accelerator))
    )
    return {
        relative: {"size": size, "sha256": digests[relative] if relative in digests else known[relative]["sha256"]}
        for relative, size in files
    }


def write_metadata(directory: str, metadata: dict[str, Any], manifest: dict[str, Any] | None = None) -> None:
    """Write the metadata with the manifest of every file already in `directory` (`build_manifest`'s, unless given);
    last: it marks completion."""
    manifest = build_manifest(directory) if manifest is None else manifest
    with open(os.path.join(directory, METADATA_NAME), "w") as f:
        json.dump({**metadata, MANIFEST_KEY: manifest}, f, indent=2)


def verify_checkpoint(checkpoint: str | os.PathLike, accelerator=None, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read the metadata and check every file of the manifest; raise naming each missing or damaged file.

    Files under the subdirectories `skip` are left out (a nested checkpoint that its own resume verifies; its
    metadata file is still checked). With an `accelerator` of several processes, call it on every process: the main
    process reads the metadata, every process checks its share of the files (`hash_shares`), and every process gets
    the metadata or the same error (a damaged file, or a process that failed while reading, named).
    """
    checkpoint = os.fspath(checkpoint)
    metadata = on_main_process(lambda: read_checkpoint_metadata(checkpoint), accelerator)
    manifest = metadata.get(MANIFEST_KEY)
    if manifest is None:
        warnings.warn(
            f"{checkpoint} has no manifest (written by an older comlrl_trl): its files are not verified.", stacklevel=3
        )
        return metadata
    skipped = tuple(f"{directory}/" for directory in skip)
    relatives = [
        relative for relative in manifest if not relative.startswith(skipped) or relative.endswith("/" + METADATA_NAME)
    ]
    rank, processes = _process(accelerator)
    shares = hash_shares([manifest[relative]["size"] for relative in relatives], processes)
    mine = [relatives[i] for i in shares[rank]]
    found = on_every_process(lambda: _check_files(checkpoint, manifest, mine), accelerator, "verifying " + checkpoint)
    problems = [problem for share in found for problem in share]
    if problems:
        order = {relative: i for i, relative in enumerate(relatives)}
        problems = [text for _, text in sorted(problems, key=lambda problem: order[problem[0]])]
        raise ValueError(
            f"Cannot resume from {checkpoint}: the checkpoint is not as it was saved.\n  "
            + "\n  ".join(problems)
            + "\nResume from another checkpoint-N directory."
        )
    return metadata


def _check_files(checkpoint: str, manifest: dict[str, Any], relatives: list[str]) -> list[tuple[str, str]]:
    """`(relative path, problem)` for each of `relatives` that is missing or differs from the manifest."""
    problems, to_hash = [], []
    for relative in relatives:
        path, expected = os.path.join(checkpoint, *relative.split("/")), manifest[relative]
        if not os.path.isfile(path):
            problems.append((relative, f"{relative} is missing"))
        elif os.path.getsize(path) != expected["size"]:
            size = os.path.getsize(path)
            problems.append((relative, f"{relative} is damaged ({size} bytes, expected {expected['size']})"))
        else:
            to_hash.append(relative)
    digests = _sha256_all([os.path.join(checkpoint, *relative.split("/")) for relative in to_hash])
    for relative, digest in zip(to_hash, digests):
        if digest != manifest[relative]["sha256"]:
            problems.append(
                (relative, f"{relative} is damaged (its sha256 differs from the one recorded when it was saved)")
            )
    return problems


def commit(staging: str, final: str) -> None:
    """Atomically move a fully written staging directory into place (replacing an older copy of the same name)."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)


def save_staged(
    root: str, name: str, token: str, write_files, accelerator, should_save: bool, keep: int | None, run_id: str
) -> str:
    """Write `root/name` crash-safely on every process: `write_files(staging)` fills a staging directory, then the
    saving process renames it into place and prunes `run_id`'s checkpoints beyond `keep`. Returns the final path."""
    staging, final = staging_dir(root, name, token), os.path.join(root, name)
    with writing_checkpoint(staging, final):
        write_files(staging)
    accelerator.wait_for_everyone()
    if should_save:
        commit(staging, final)
        prune(root, keep, run_id)
    accelerator.wait_for_everyone()
    return final


def prune(root: str, keep: int | None, run_id: str) -> None:
    """Delete the oldest checkpoints of `run_id` beyond `keep`; the newest is always kept."""
    if keep is None:
        return
    own = [(seq, path) for seq, path in list_checkpoints(root) if read_checkpoint_metadata(path)["run_id"] == run_id]
    for _, path in own[: max(len(own) - max(keep, 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what makes two tokenizers interchangeable: vocabulary, special tokens, chat template."""
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update(str(tokenizer.chat_template).encode())
    return digest.hexdigest()[:16]


def model_fingerprint(model) -> str:
    """A short hash of a model's class and parameter names, shapes and dtypes."""
    digest = hashlib.sha256(type(model).__name__.encode())
    for name, parameter in model.state_dict().items():
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
    return digest.hexdigest()[:16]


def check_checkpoint_options(interval, total_limit) -> None:
    """Validate `train(checkpoint_interval=..., checkpoint_total_limit=...)`."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"checkpoint_interval must be a positive integer, got {interval!r}.")
    if total_limit is not None and (
        isinstance(total_limit, bool) or not isinstance(total_limit, int) or total_limit < 1
    ):
        raise ValueError(f"checkpoint_total_limit must be a positive integer or None, got {total_limit!r}.")


def refuse_foreign_checkpoints(root: str | None, run_id: str) -> None:
    """A checkpoint directory belongs to one run: refuse to write next to another run's checkpoints."""
    if root is None:
        return
    foreign = [path for _, path in list_checkpoints(root) if read_checkpoint_metadata(path)["run_id"] != run_id]
    if foreign:
        raise FileExistsError(
            f"{root!r} already holds checkpoints of another run ({os.path.basename(foreign[0])}, ...). Use a new "
            "checkpoint directory, or resume from one of them."
        )


def check_world_size(saved: int | None, current: int, path: str, deepspeed: bool) -> None:
    """Refuse to resume a checkpoint written by another number of processes (`saved`; None: not recorded, before
    comlrl_trl recorded it), naming both numbers and the way out."""
    if saved is None or saved == current:
        return
    if deepspeed:
        why = (
            "DeepSpeed partitions the ZeRO optimiser state (and under ZeRO-3 the weights) over the data-parallel "
            "processes, so its shards load only into the same number of processes."
        )
        fix = (
            f"Resume with {saved} processes (e.g. `accelerate launch --num_processes {saved}` or `torchrun "
            f"--nproc_per_node ...` with {saved} in all), or convert the shards of every checkpoint-N/agent_i: "
            "DeepSpeed's zero_to_fp32.py there gives the full weights to start a new run from (the optimiser state is "
            "lost), and its ds_to_universal.py gives a universal checkpoint that DeepSpeed can load on another number "
            "of processes (load it yourself: comlrl_trl resumes only its own layout)."
        )
    else:
        why = (
            "Each process trains on per_device_train_batch_size items per step, so the global batch, the learning "
            "rate per item and the position in the data (the items already trained on are skipped by count) would "
            "change, and the resumed run would not continue the saved one."
        )
        fix = (
            f"Resume with {saved} processes, or start a new run from the checkpoint's weights (checkpoint-N/agent_i, "
            "loadable with from_pretrained) with the number of processes you want."
        )
    raise ValueError(
        f"Cannot resume from {path}: it was saved by a run of {saved} processes and this run has {current}. {why} "
        f"{fix}"
    )


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: str) -> None:
    """Refuse to resume into a different run: name every field of the fingerprint that differs."""
    current = json.loads(json.dumps(current, default=str))  # as the checkpoint's copy was read back
    differences = [
        f"{key}: checkpoint has {saved.get(key)!r}, this trainer has {current[key]!r}"
        for key in current
        if saved.get(key) != current[key]
    ]
    if differences:
        raise ValueError(
            f"Cannot resume from {path}: the checkpoint does not match this trainer.\n  "
            + "\n  ".join(differences)
            + "\nThese settings change the result, so a resumed run must "
            "keep the checkpoint's values (num_train_epochs and max_steps may grow); or start a new run."
        )


# ----- user objects that carry state across a resume -----


def is_stateful(obj, name: str) -> bool:
    """Whether a user object's state is checkpointed: it has both `state_dict` and `load_state_dict`.

    One without the other is an error: its state could be saved but not restored (or the reverse), and leaving
    it out silently would make a resumed run differ.
    """
    from datasets import IterableDataset

    methods = [method for method in ("state_dict", "load_state_dict") if callable(getattr(obj, method, None))]
    if len(methods) == 1:
        missing = "load_state_dict" if methods == ["state_dict"] else "state_dict"
        raise TypeError(
            f"{name} ({type(obj).__name__}) defines {methods[0]}() but not {missing}(); define both so "
            "that checkpoints save and restore its state, or neither to leave it out of them."
        )
    if obj is None or not methods:
        return False
    # A streaming dataset's position is restored by the data loader, not by its own state.
    return not (isinstance(obj, IterableDataset) and type(obj).state_dict is IterableDataset.state_dict)


def stateful_objects(candidates: dict[str, Any]) -> dict[str, Any]:
    """The candidates (name -> user object) whose state checkpoints keep."""
    return {name: obj for name, obj in candidates.items() if is_stateful(obj, name)}


def objects_state(objects: dict[str, Any]) -> dict[str, Any]:
    return {name: obj.state_dict() for name, obj in objects.items()}


def restore_objects(objects: dict[str, Any], saved: dict[str, Any], checkpoint: str) -> None:
    """Load every object's saved state; the checkpoint and the trainer must hold the same stateful objects."""
    if set(objects) != set(saved):
        raise ValueError(
            f"Cannot resume from {checkpoint}: the stateful objects differ (checkpoint: "
            f"{sorted(saved)}, this trainer: {sorted(objects)})."
        )
    for name, obj in objects.items():
        obj.load_state_dict(saved[name])
