"""A cgroup per sandbox run: memory and process-count limits for a whole process tree, where the system allows.

Uses the cgroup v1 `memory` and `pids` controllers when both are mounted and writable (the case on this
project's machines), else cgroup v2 when this process's cgroup delegates both controllers to its children.
`RunCgroup.create` returns None otherwise (and `warn_once` says so once per process).
"""

import functools
import os
import signal
import time
import uuid
import warnings


class RunCgroup:
    """One run's cgroup directories (one per controller for v1, one for v2); processes join via `procs_files`."""

    def __init__(self, dirs: list[str]):
        self.dirs = dirs
        self.procs_files = [os.path.join(path, "cgroup.procs") for path in dirs]

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> "RunCgroup | None":
        """A new cgroup limited to `memory_bytes` (swap included where it can) and `max_processes`, or None."""
        layout = _layout()
        if layout is None:
            return None
        version, parents = layout
        name = f"comlrl-sandbox-{uuid.uuid4().hex[:12]}"
        dirs = []
        try:
            for parent in parents:
                dirs.append(os.path.join(parent, name))
                os.mkdir(dirs[-1])
            limits = (
                {
                    "memory.limit_in_bytes": memory_bytes,
                    "memory.memsw.limit_in_bytes": memory_bytes,
                    "pids.max": max_processes,
                }
                if version == 1
                else {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": max_processes}
            )
            for path in dirs:
                for key, value in limits.items():
                    if os.path.exists(os.path.join(path, key)):
                        with open(os.path.join(path, key), "w") as handle:
                            handle.write(str(value))
        except OSError as error:
            cls(dirs).remove()
            _warn_once(f"cannot set up a cgroup ({error})")
            return None
        return cls(dirs)

    def kill(self) -> None:
        """SIGKILL every process in the cgroup, until none is left (at most about a second)."""
        pause = 0.0005
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            pids = [pid for path in self.procs_files for pid in _read_pids(path)]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(pause)  # short at first: the processes of a finished run are usually gone within 1-2 ms
            pause = min(2 * pause, 0.005)

    def remove(self) -> None:
        self.kill()
        for path in self.dirs:
            for _attempt in range(50):  # the kernel may need a moment after the last process exits
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as handle:
            return [int(line) for line in handle if line.strip()]
    except OSError:
        return []


@functools.cache
def _layout() -> tuple[int, list[str]] | None:
    """(1, [memory dir, pids dir]) or (2, [dir]): this process's cgroups to create run cgroups in; None if none."""
    try:
        with open("/proc/self/mountinfo") as handle:
            mounts = [line.split(" - ", 1) for line in handle if " - " in line]
        with open("/proc/self/cgroup") as handle:
            memberships = [line.rstrip("\n").split(":", 2) for line in handle]
    except OSError:
        _warn_once("cannot read /proc/self/mountinfo or /proc/self/cgroup")
        return None
    v1 = [_v1_dir(mounts, memberships, controller) for controller in ("memory", "pids")]
    if all(path is not None and os.access(path, os.W_OK) for path in v1):
        return 1, v1
    v2 = _v2_dir(mounts, memberships)
    if v2 is not None and os.access(v2, os.W_OK) and {"memory", "pids"} <= set(_read(v2, "cgroup.subtree_control")):
        return 2, [v2]
    _warn_once("no writable cgroup with the memory and pids controllers")
    return None


def _v1_dir(mounts, memberships, controller: str) -> str | None:
    point = next(
        (
            head.split()[4]
            for head, tail in mounts
            if tail.split()[0] == "cgroup" and controller in tail.split()[2].split(",")
        ),
        None,
    )
    path = next((rel for _, names, rel in memberships if controller in names.split(",")), None)
    return None if point is None or path is None else os.path.join(point, path.lstrip("/"))


def _v2_dir(mounts, memberships) -> str | None:
    point = next((head.split()[4] for head, tail in mounts if tail.split()[0] == "cgroup2"), None)
    path = next((rel for hierarchy, names, rel in memberships if hierarchy == "0" and names == ""), None)
    return None if point is None or path is None else os.path.join(point, path.lstrip("/"))


def _read(directory: str, name: str) -> list[str]:
    try:
        with open(os.path.join(directory, name)) as handle:
            return handle.read().split()
    except OSError:
        return []


def _warn_once(reason: str) -> None:
    if not _WARNED:
        _WARNED.append(reason)
        warnings.warn(
            f"comlrl_trl sandbox: {reason}; memory is limited per process (RLIMIT_AS) and processes per "
            "run by RLIMIT_NPROC, so one run's process tree may use up to MAX_PROCESSES x memory_mb.",
            RuntimeWarning,
            stacklevel=3,
        )


_WARNED: list[str] = []
