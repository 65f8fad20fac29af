"""Run untrusted, model-written Python against a list of `assert` tests, in a separate limited process.

`run_python(code, tests)` starts a fresh interpreter (`sys.executable -I -S`: isolated mode, no user site, no
site-packages, `PYTHON*` variables ignored) in an empty temporary directory, with an environment stripped to
`PATH`, `HOME`/`TMPDIR` (the temporary directory) and the locale, so the parent's secrets are not in
`os.environ`. A small trusted harness runs first and, before it reads the candidate code:

* sets resource limits on itself: address space (`memory_mb`), CPU seconds, open files, file size (which also
  bounds what the code can print) and no core dumps;
* disables Python-level networking: `socket.socket`, `socket.create_connection`, ... (and their `_socket`
  twins) are replaced by a function that raises `PermissionError`.

It then executes the candidate code, then every test separately (one failing or crashing test does not stop
the others), and prints one JSON summary line tagged with a random nonce that the candidate code is not given.
The parent enforces a wall-clock `timeout` and kills the whole process group (the child runs in its own
session), so a hanging or forking program never blocks the caller: a timeout returns `timed_out=True` with
`passed=0`.

The limits are set by the harness rather than through `Popen(preexec_fn=...)`: the untrusted code only ever
runs after them, and no Python code runs between `fork` and `exec` in the (multi-threaded) trainer, which the
`subprocess` documentation warns may deadlock. `RLIMIT_NPROC` is not used: it counts every process of the
user (and is ignored for root), so it cannot express "this program may not fork"; the process-group kill
cleans up any children instead.

This is a best-effort guard against accidents (endless loops, memory blow-ups, huge outputs, network calls,
files written to the working directory), not a security boundary. The code runs as the same user as the
trainer: it can read and write what that user can (including the trainer's `/proc/<ppid>/environ`, secrets and
all), reload `socket` to reach the network, find the harness's nonce by inspecting its frames, and with
`CAP_SYS_RESOURCE` (often root) raise its own limits. Adversarial code needs real isolation: a container or VM
with no network, a read-only file system, an unprivileged user and seccomp. POSIX only.
"""

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field


MAX_ERRORS = 5  # error messages kept per run
MAX_ERROR_CHARS = 200  # each error message is truncated to this length
MAX_OUTPUT_BYTES = 4 * 1024 * 1024  # RLIMIT_FSIZE: the most the child may write to any file, stdout included
MAX_OPEN_FILES = 32


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run: how many of the `total` tests passed, and why the others did not."""

    passed: int
    total: int
    errors: list[str] = field(default_factory=list)
    timed_out: bool = False
    test_passed: list[bool] = field(default_factory=list)  # one entry per test, in order (empty when none ran)

    @property
    def pass_rate(self) -> float:
        """`passed / total`, 0.0 without tests."""
        return self.passed / self.total if self.total else 0.0


def run_python(code: str, tests: Sequence[str], timeout: float = 2.0, memory_mb: int = 256,
               setup: str = "") -> SandboxResult:
    """Execute `code`, then each test in `tests` (Python statements, usually `assert ...` lines) separately.

    Args:
        code: the untrusted program, e.g. function definitions written by a model.
        tests: statements run one by one after `code`, in the same namespace; a test passes when it raises
            nothing. For `assert a == b` the failure message shows the value of `a`.
        timeout: wall-clock seconds for the whole run (interpreter start-up included); CPU time is limited to
            about the same.
        memory_mb: address-space limit of the child process in MiB.
        setup: trusted statements (imports, helper definitions such as `candidate = my_function`) run once
            before the tests, in the tests' namespace; an error there fails every test.

    Returns:
        A `SandboxResult`. A syntax error gives `passed=0` and the error text; an error while executing `code`
        is reported and the tests still run against what was defined; a timeout gives `passed=0`,
        `timed_out=True`.
    """
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

    total = len(tests)
    nonce = secrets.token_hex(16)
    limits = [str(int(memory_mb) * 1024 * 1024), str(math.ceil(timeout) + 1), str(MAX_OUTPUT_BYTES),
              str(MAX_OPEN_FILES)]
    payload = json.dumps({"code": code, "tests": tests, "setup": setup, "nonce": nonce}).encode()
    with tempfile.TemporaryDirectory(prefix="comlrl-sandbox-") as root:
        work = os.path.join(root, "work")
        os.mkdir(work)
        harness = os.path.join(root, "harness.py")
        with open(harness, "w", encoding="utf-8") as handle:
            handle.write(_HARNESS)
        with open(os.path.join(root, "stdout"), "w+b") as stdout, open(os.path.join(root, "stderr"), "w+b") as stderr:
            returncode, timed_out = _run(
                [sys.executable, "-I", "-S", harness, *limits], payload, stdout, stderr, work, timeout)
            summary = _find_summary(_tail(stdout), nonce)
            stderr_tail = _tail(stderr).decode("utf-8", errors="replace")

    if timed_out or returncode == -signal.SIGXCPU:
        return SandboxResult(0, total, [f"Timeout: the program ran longer than {timeout:g} s"], timed_out=True,
                             test_passed=[False] * total)
    if summary is None:
        last = stderr_tail.strip().splitlines()[-1:] or ["no output"]
        message = f"Crash: the program exited (code {returncode}) before reporting: {last[0]}"
        return SandboxResult(0, total, [_short(message)], test_passed=[False] * total)
    outcomes = summary.get("outcomes", [])
    test_passed = [bool(value) for value in outcomes] if len(outcomes) == total else [False] * total
    errors = [_short(str(error)) for error in summary.get("errors", [])][:MAX_ERRORS]
    return SandboxResult(sum(test_passed), total, errors, test_passed=test_passed)


def _run(command: list[str], payload: bytes, stdout, stderr, cwd: str, timeout: float) -> tuple[int, bool]:
    """Start the child in its own session, feed it the payload, wait at most `timeout` s, kill its group."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, cwd=cwd,
                               env=_child_env(cwd), start_new_session=True, close_fds=True)
    timed_out = False
    try:
        process.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(process.pid)  # the child and anything it started
        try:
            if process.stdin is not None:
                process.stdin.close()
        except OSError:
            pass
        process.wait()
    return process.returncode, timed_out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _child_env(home: str) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    if "LD_LIBRARY_PATH" in os.environ:  # some Python builds need it to start at all
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def _tail(handle, size: int = 64 * 1024) -> bytes:
    handle.flush()
    end = handle.seek(0, os.SEEK_END)
    handle.seek(max(0, end - size))
    return handle.read()


def _find_summary(output: bytes, nonce: str) -> dict | None:
    """The harness's JSON summary: the text after the last occurrence of the nonce, up to the line end."""
    text = output.decode("utf-8", errors="replace")
    start = text.rfind(nonce)
    if start < 0:
        return None
    line = text[start + len(nonce):].split("\n", 1)[0]
    try:
        summary = json.loads(line)
    except ValueError:
        return None
    return summary if isinstance(summary, dict) else None


def _short(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The trusted harness, run by the child interpreter as a script. argv: address-space bytes, CPU seconds, file
# size bytes, open files. stdin: {"code", "tests", "nonce"} as JSON. It must only use the standard library.
_HARNESS = r'''
import ast
import json
import os
import resource
import socket
import sys

MAX_ERRORS = 5


def limit_resources(address_space, cpu_seconds, file_size, open_files):
    for kind, value in ((resource.RLIMIT_AS, address_space), (resource.RLIMIT_CPU, cpu_seconds),
                        (resource.RLIMIT_FSIZE, file_size), (resource.RLIMIT_NOFILE, open_files),
                        (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (value, value))


def block_network():
    import _socket

    def no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    for module in (socket, _socket):
        for name in ("socket", "SocketType", "socketpair", "fromfd", "create_connection", "create_server",
                     "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
            if hasattr(module, name):
                setattr(module, name, no_network)


class Sink:
    """Swallows what the candidate prints through sys.stdout / sys.stderr."""

    def write(self, text):
        return len(text)

    def flush(self):
        pass


def short(text, limit):
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check(test, namespace):
    """None when the test passes, else a one-line reason."""
    try:
        tree = ast.parse(test, mode="exec")
        node = tree.body[0] if len(tree.body) == 1 else None
        if (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                and isinstance(node.test.ops[0], ast.Eq) and node.msg is None):
            got = eval(compile(ast.Expression(node.test.left), "<test>", "eval"), namespace)
            expected = eval(compile(ast.Expression(node.test.comparators[0]), "<test>", "eval"), namespace)
            if bool(got == expected):
                return None
            return test + "  # got " + short(repr(got), 80)
        exec(compile(tree, "<test>", "exec"), namespace)
        return None
    except AssertionError as error:
        return test + "  # AssertionError" + (": " + str(error) if str(error) else "")
    except BaseException as error:
        return test + "  # " + type(error).__name__ + ": " + str(error)


def main():
    request = json.loads(sys.stdin.read())
    report = os.dup(1)
    limit_resources(*(int(value) for value in sys.argv[1:5]))
    block_network()
    sys.stdout = sys.stderr = Sink()
    code, tests, setup, nonce = request["code"], request["tests"], request["setup"], request["nonce"]
    del request
    outcomes, errors = [False] * len(tests), []
    try:
        compiled = compile(code, "<candidate>", "exec")
    except SyntaxError as error:
        compiled = None
        where = " (line " + str(error.lineno) + ")" if error.lineno else ""
        errors.append(type(error).__name__ + ": " + str(error.msg) + where)
    except BaseException as error:  # e.g. null bytes in the source
        compiled = None
        errors.append(type(error).__name__ + ": " + str(error))
    if compiled is not None:
        namespace = {"__name__": "__sandbox__"}
        try:
            exec(compiled, namespace)
        except BaseException as error:
            errors.append(type(error).__name__ + " while running the code: " + str(error))
        setup_error = check(setup, namespace) if setup else None
        if setup_error is not None:
            errors.append("setup failed: " + setup_error)
        for index, test in enumerate(tests):
            failure = check(test, namespace) if setup_error is None else "skipped"
            if failure is None:
                outcomes[index] = True
            elif setup_error is None:
                errors.append(failure)
    summary = {"outcomes": outcomes, "errors": [short(e, 200) for e in errors[:MAX_ERRORS]]}
    os.write(report, ("\n" + nonce + json.dumps(summary) + "\n").encode("utf-8", errors="replace"))
    os._exit(0)  # skip atexit handlers and threads the candidate may have left behind


main()
'''
