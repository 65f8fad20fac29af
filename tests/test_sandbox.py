"""The sandbox's integrity: reward-faking attacks score low, and the isolation holds (network, processes, memory,
secrets, files). Each attack below scored the full reward with the old sandbox (issue 12)."""

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from comlrl_trl.tasks import code_feedback as task
from comlrl_trl.tasks import sandbox
from comlrl_trl.tasks.sandbox import MAX_PROCESSES, cgroup, checker, codec, isolation_mode, run_python


ISOLATED = pytest.mark.skipif(
    isolation_mode() != "namespaces", reason="needs Linux namespaces (root); this system runs the sandbox's fallback"
)
ROOT = str(Path(__file__).resolve().parents[1])  # the repository: the scripts below import comlrl_trl from it
HELPER = "def aux(ch):\n    return ch.lower() in 'aeiou'\n"
WRONG = "\n    return 2\n"  # count_vowels("hello") == 2 is the only test this passes

# Each defines a wrong count_vowels (it returns 2) plus an attempt to make the tests pass anyway; top-level code comes
# after the first `def`, where `extract_code` keeps it.
ATTACKS = {
    "main_module_checker": "import sys\ndef count_vowels(s):\n    main = sys.modules['__main__']\n"
    "    for name in dir(main):\n        if callable(getattr(main, name)):\n"
    "            setattr(main, name, lambda *a, **k: None)" + WRONG,
    "always_equal": "def count_vowels(s):\n    class Yes:\n        def __eq__(self, other):\n            return True\n"
    "        def __bool__(self):\n            return True\n        __hash__ = object.__hash__\n"
    "    return Yes()\n",
    "int_subclass": "def count_vowels(s):\n    class Two(int):\n        def __eq__(self, other):\n"
    "            return True\n    return Two(2)\n",
    "builtins": "import builtins\ndef count_vowels(s):" + WRONG + "builtins.bool = lambda *a: True\n"
    "builtins.AssertionError = type('Harmless', (Exception,), {})\n",
    "compile_and_ast": "import ast, builtins\ndef count_vowels(s):"
    + WRONG
    + "PASS = ast.parse('pass')\nast.parse = lambda *a, **k: PASS\n"
    "builtins.compile = (lambda real: lambda *a, **k: real(PASS, '<x>', 'exec'))(compile)\n",
    "forged_report_and_exit": (
        "import json, os, sys\n"
        "def count_vowels(s):\n"
        "    frame, fds, nonces = sys._getframe(), set(range(64)), set()\n"
        "    while frame:\n"
        "        for value in frame.f_locals.values():\n"
        "            if type(value) is str and len(value) == 32:\n"
        "                nonces.add(value)\n"
        "        frame = frame.f_back\n"
        "    summary = json.dumps({'outcomes': [True] * 4, 'errors': []})\n"
        "    forged = json.dumps({'value': ['I', '5'], 'outcomes': [True] * 4}).encode()\n"
        "    for fd in fds:\n"
        "        for nonce in nonces:\n"
        "            try:\n"
        "                os.write(fd, ('\\n' + nonce + summary + '\\n').encode())\n"
        "            except OSError:\n"
        "                pass\n"
        "        try:\n"
        "            os.write(fd, len(forged).to_bytes(4, 'big') + forged)\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
    ),
}


def _count_vowels_item():
    return next(row for row in task.build_dataset("train") if row["entry_point"] == "count_vowels")


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_reward_faking_attacks_score_low(attack):
    item = _count_vowels_item()
    reward = task.reward([HELPER], [ATTACKS[attack]], batch_items=[item], hidden_tests=False)[0]  # all 4 tests
    result = task.run_tests(HELPER, ATTACKS[attack], item["tests"])
    assert result.passed <= 1, result
    assert reward <= 0.25 + 2 * task.STRUCTURE_BONUS, reward  # the correct program gets 1.2


def test_general_asserts_setup_and_exceptions():
    code = (
        "def half(x):\n    return x / 2\ndef pair(a, b):\n    return (a, [b], {a: b})\n"
        "def picky(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
        "def abs(x):\n    return 0\n"
    )  # shadows a built-in: must not reach the tests
    tests = [
        "assert abs(candidate(1.0) - 0.5) < 1e-6",
        "for i in range(3):\n    assert candidate(2 * i) == i",
        "assert pair(1, 'b') == (1, ['b'], {1: 'b'})",
        "assert True",
        "assert close(candidate(3), 1.5)",
        "try:\n    picky(-1)\n    raise AssertionError('no error')\nexcept ValueError as error:\n"
        "    assert str(error) == 'negative'",
        "assert abs(-3) == 0",
        "assert candidate(float('inf')) > 1e308",
    ]
    setup = "import math\ncandidate = half\ndef close(a, b):\n    return math.isclose(a, b)"
    result = run_python(code, tests, setup=setup)
    assert result.test_passed == [True, True, True, True, True, True, False, True], result.errors
    assert result.errors == ["assert abs(-3) == 0  # got 3"]


def test_a_crash_fails_only_its_own_test_and_a_timeout_keeps_earlier_passes():
    code = "import os\ndef f(x):\n    if x == 1:\n        os._exit(3)\n    while x == 2:\n        pass\n    return x\n"
    result = run_python(
        code,
        ["assert f(0) == 0", "assert f(1) == 1", "assert f(5) == 5", "assert f(2) == 2", "assert f(7) == 7"],
        timeout=1.5,
    )
    assert result.test_passed == [True, False, True, False, False] and result.timed_out
    assert "Crash" in result.errors[0] and "Timeout" in result.errors[1]


def test_values_that_are_not_plain_data_fail_the_test():
    code = "def gen():\n    return (i for i in range(3))\ndef fn():\n    return fn\nlimit = 3\n"
    result = run_python(
        code,
        [
            "assert list(gen()) == [0, 1, 2]",
            "assert fn() is not None",
            "assert limit == 3",
            "assert gen(lambda: 1) is None",
        ],
    )
    assert result.test_passed == [False, False, True, False]
    assert "generator cannot cross the sandbox boundary" in result.errors[0]
    assert "cannot be sent to the sandbox" in result.errors[2]


def test_codec_round_trip_and_strictness():
    value = [
        None,
        True,
        -7,
        10**40,
        1.5,
        float("inf"),
        "é\udc80",
        b"\x00\xff",
        (1, [2]),
        {"k": {3}},
        frozenset({4}),
        {(1, 2): None},
    ]
    assert codec.decode(codec.parse(codec.frame({"v": codec.encode(value)})[4:])["v"]) == value
    nan = codec.decode(codec.encode(float("nan")))
    assert nan != nan
    with pytest.raises(TypeError, match="cannot cross"):
        codec.encode(type("MyInt", (int,), {})(1))
    for bad in (["I", 5], ["B", 1], ["L", 1], ["D", [["N"]]], ["E", [["L", []]]], ["Q", 1], [], "S", ["N", 1]):
        with pytest.raises(ValueError):
            codec.decode(bad)
    with pytest.raises(ValueError, match="nested"):
        codec.encode(_nested(codec.MAX_DEPTH + 2))
    colliding = {k * (2**61 - 1) for k in range(codec.MAX_HASHED_ITEMS + 1)}  # all hash to 0
    with pytest.raises(ValueError, match="set elements and dict keys"):
        codec.decode(codec.encode(colliding))


def _nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture
def fallback(monkeypatch):
    """The sandbox as on a system without namespaces (the child is started without isolation)."""
    monkeypatch.setattr(checker, "_DISABLED", ["none: unshare failed (forced by the test)"])
    monkeypatch.setattr(checker, "_WARNED", [])
    monkeypatch.delenv(sandbox.ALLOW_UNISOLATED_ENV, raising=False)
    assert isolation_mode() == "fallback"


def test_fallback_refuses_without_consent_and_says_what_is_lost(fallback, monkeypatch):
    item = _count_vowels_item()
    with pytest.raises(sandbox.UnisolatedError) as refused:
        run_python("def f():\n    return 1\n", ["assert f() == 1"])
    message = str(refused.value)
    for lost in ("network", "files", "answer keys", "kill the trainer's processes", "allow_unisolated=True"):
        assert lost in message
    assert f"{sandbox.ALLOW_UNISOLATED_ENV}=1" in message
    with pytest.raises(sandbox.UnisolatedError):  # the code tasks refuse as well
        task.reward([HELPER], [ATTACKS["always_equal"] + "# refused\n"], batch_items=[item])
    monkeypatch.setenv(sandbox.ALLOW_UNISOLATED_ENV, "yes")  # only "1" counts
    with pytest.raises(sandbox.UnisolatedError):
        run_python("def f():\n    return 1\n", ["assert f() == 1"])


def test_fallback_with_consent_warns_once_and_still_computes_the_verdict(fallback, monkeypatch):
    item = _count_vowels_item()
    code = "import os\ndef home_is_cwd():\n    return os.environ['HOME'] == os.getcwd() != '/tmp'\n"
    with pytest.warns(RuntimeWarning, match="no namespace isolation \\(none: unshare failed"):
        assert run_python(code, ["assert home_is_cwd()"], allow_unisolated=True).passed == 1  # a private directory
    monkeypatch.setenv(sandbox.ALLOW_UNISOLATED_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert run_python(code, ["assert home_is_cwd()"]).passed == 1
        assert task.reward([HELPER], [ATTACKS["always_equal"] + "# fallback\n"], batch_items=[item])[0] <= 0.1 + 1e-9


SURVIVOR = """
import ctypes, os, time
libc = ctypes.CDLL(None)
def survive():
    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
    libc.prctl(15, b"{tag}", 0, 0, 0)  # PR_SET_NAME: findable in /proc
    try:
        os.setsid()
    except OSError:
        pass
    if os.fork() == 0:
        libc.prctl(1, 0, 0, 0, 0)
        os.setsid()
        if os.fork() == 0:
            os.execv('/usr/bin/sleep', ['sleep', '{marker}'])
        os._exit(0)
    time.sleep(60)  # the run times out while this call is in progress
    return 1
"""


@pytest.mark.parametrize("mode", ["namespaces", "fallback"])
def test_no_process_outlives_a_run_without_a_cgroup(mode, monkeypatch, request):
    """The first process of the run clears its parent-death signal and leaves its session; so does a grandchild."""
    if mode == "namespaces" and isolation_mode() != "namespaces":
        pytest.skip("needs Linux namespaces (root)")
    if mode == "fallback":
        request.getfixturevalue("fallback")
        monkeypatch.setenv(sandbox.ALLOW_UNISOLATED_ENV, "1")
        warnings.simplefilter("ignore", RuntimeWarning)
    monkeypatch.setattr(sandbox.RunCgroup, "create", classmethod(lambda cls, *args: None))
    tag = f"sbx{secrets.token_hex(5)}"
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(10**6):06d}"
    result = run_python(SURVIVOR.format(tag=tag, marker=marker), ["assert survive() == 1"], timeout=1.5)
    assert result.timed_out and result.passed == 0, result.errors
    deadline = time.monotonic() + 3.0
    while _live(tag, marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live(tag, marker) == []


def _live(tag: str, marker: str) -> list[str]:
    """Processes (not zombies) named `tag` or running `sleep marker`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        text = _read(stat)
        name, _, rest = text.partition(") ")
        if rest[:1] != "Z" and (name.endswith("(" + tag) or marker in _read(stat.with_name("cmdline"))):
            found.append(text[:60])
    return found


# ----- isolation (Linux, root) -----


@ISOLATED
def test_no_network_by_any_route():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(1.5)
    port = listener.getsockname()[1]
    code = f"""
import ctypes, importlib, os, subprocess, sys
def attempt():
    tried = []
    try:
        sys.modules.pop('_socket', None)
        raw = importlib.import_module('_socket')
        raw.socket().connect(('127.0.0.1', {port}))
        tried.append('socket')
    except OSError as error:
        tried.append(str(error))
    tried.append(os.system("bash -c 'echo x > /dev/tcp/127.0.0.1/{port}'"))
    tried.append(subprocess.run(['bash', '-c', 'echo x > /dev/tcp/127.0.0.1/{port}']).returncode)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    address = (2).to_bytes(2, 'little') + ({port}).to_bytes(2, 'big') + bytes([127, 0, 0, 1]) + bytes(8)
    tried.append(libc.connect(fd, address, 16))
    return tried
"""
    result = run_python(code, ["result = attempt()", "assert result[0] == 'socket'"], timeout=5.0)
    assert result.test_passed == [True, False], result.errors
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing arrived by any of the four routes
    listener.close()


@ISOLATED
def test_no_process_survives_the_run():
    marker = f"{secrets.randbelow(10**6)}.{secrets.randbelow(10**6):06d}"
    code = f"""
import os, time
def escape(n):
    for _ in range(n):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv('/usr/bin/sleep', ['sleep', '{marker}'])
            os._exit(0)
    time.sleep(0.2)
    return n
"""
    result = run_python(code, ["assert escape(2) == 2"])
    assert result.passed == 1, result.errors
    time.sleep(1.0)
    assert not [path for path in Path("/proc").glob("[0-9]*/cmdline") if marker in _read(path)]


@ISOLATED
def test_process_count_is_limited():
    code = (
        "import os, time\ndef spawn(n):\n    started = 0\n    for _ in range(n):\n        try:\n"
        "            if os.fork() == 0:\n                time.sleep(2)\n                os._exit(0)\n"
        "            started += 1\n        except OSError:\n            break\n    return started\n"
    )
    result = run_python(code, [f"assert spawn(50) < {MAX_PROCESSES}"], timeout=4.0)
    assert result.passed == 1, result.errors


@pytest.mark.skipif(cgroup._layout() is None, reason="no writable cgroup: memory is limited per process only")
def test_memory_is_limited_for_the_whole_process_tree():
    code = (
        "import os\ndef grow(children, mib):\n    pids = []\n    for _ in range(children):\n"
        "        pid = os.fork()\n        if pid == 0:\n            block = b'x' * (mib << 20)\n"
        "            os._exit(0 if len(block) else 1)\n        pids.append(pid)\n"
        "    return sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 for pid in pids)\n"
    )
    capped = run_python(code, ["assert grow(3, 200) == 3"], memory_mb=256, timeout=10.0)
    assert capped.passed == 0, capped.errors  # each child alone fits in 256 MiB, the three together do not
    roomy = run_python(code, ["assert grow(3, 200) == 3"], memory_mb=1024, timeout=10.0)
    assert roomy.passed == 1, roomy.errors


@ISOLATED
def test_no_secret_from_the_parent_environment(monkeypatch):
    token = "hunter2-" + secrets.token_hex(8)
    monkeypatch.setenv("SECRET_TOKEN", token)
    holder = subprocess.Popen(["sleep", "30"], env={**os.environ, "SECRET_TOKEN": token})
    try:
        for _ in range(100):  # until `sleep` runs
            if token in _read(Path(f"/proc/{holder.pid}/environ")):
                break
            time.sleep(0.01)
        assert token in _read(Path(f"/proc/{holder.pid}/environ"))  # readable from here, not from the sandbox
        code = f"""
import os
def leak():
    seen = [repr(dict(os.environ))]
    for pid in ['{holder.pid}', '{os.getpid()}', str(os.getppid()), 'self', *os.listdir('/proc')]:
        try:
            with open('/proc/' + pid + '/environ', 'rb') as handle:
                seen.append(handle.read().decode(errors='replace'))
        except OSError:
            pass
    return ' '.join(seen)
"""
        result = run_python(code, [f"assert {token!r} not in leak()", "assert 'SECRET_TOKEN' not in leak()"])
        assert result.passed == 2, result.errors
    finally:
        holder.kill()
        holder.wait()


@ISOLATED
def test_nothing_is_written_outside_the_private_tmp(tmp_path):
    site_packages = os.path.join(os.path.dirname(os.__file__), "site-packages")  # inside the exposed stdlib
    targets = [
        Path(task.__file__).with_name("planted.py"),
        tmp_path / "planted.txt",
        Path(os.__file__).with_name("planted.py"),
        Path("/tmp") / f"planted-{secrets.token_hex(4)}",
    ]
    code = f"""
import os
def plant(paths):
    written = []
    for path in paths:
        try:
            with open(path, 'w') as handle:
                handle.write('x')
            written.append(path)
        except OSError:
            pass
    return written
def answer_key():
    return open({task.__file__!r}).read()
def packages():
    return sorted(os.listdir({site_packages!r})) if os.path.isdir({site_packages!r}) else []
"""
    outside = [str(path) for path in targets[:3]]
    try:
        result = run_python(
            code,
            [
                f"assert plant({outside!r}) == []",
                f"plant([{str(targets[3])!r}])",
                "assert plant(['scratch.txt']) == ['scratch.txt']",
                "answer_key()",
                "assert packages() == []",
            ],
        )
        planted = [path for path in targets if path.exists()]
    finally:
        for path in targets:
            path.unlink(missing_ok=True)
    assert result.test_passed == [True, True, True, False, True], result.errors
    assert "FileNotFoundError" in result.errors[0]  # the task's source (its tests) is not in the sandbox's tree
    assert planted == []


def _read(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ----- issue 24: control flow, codec strictness, reply caps, and a red-team pass -----


def test_exceptions_from_the_candidate_cannot_steer_the_checkers_control_flow():
    code = (
        "def stop(x):\n    raise StopIteration\n"
        "def stop_async(x):\n    raise StopAsyncIteration\n"
        "def gen_exit(x):\n    raise GeneratorExit\n"
        "def sys_exit(x):\n    raise SystemExit(0)\n"
        "def interrupt(x):\n    raise KeyboardInterrupt\n"
        "def picky(x):\n    raise ValueError('negative')\n"
    )
    tests = [
        "assert all(map(lambda x: stop(x) == 2 * x, [1, 2]))",  # StopIteration would end map: all([]) is True
        "assert list(filter(lambda x: stop(x) != 2 * x, [1, 2])) == []",
        "assert list(map(stop_async, [1])) == []",
        "assert list(map(gen_exit, [1])) == []",
        "assert sys_exit(1) is None",
        "assert interrupt(1) is None",
        "try:\n    picky(1)\nexcept ValueError as error:\n    assert isinstance(error, CandidateError)\n"
        "    assert str(error) == 'negative'",
        "try:\n    stop(1)\nexcept CandidateError as error:\n    assert not isinstance(error, StopIteration)",
    ]
    setup = "from comlrl_trl.tasks.sandbox import CandidateError"
    result = run_python(code, tests, setup=setup)
    assert result.test_passed == [False] * 6 + [True, True], result.errors
    assert "CandidateError: StopIteration" in result.errors[0]


@pytest.mark.parametrize("base", [int, float, str, bytes, list, tuple, dict, set, frozenset])
def test_codec_refuses_subclasses_of_every_accepted_type(base):
    value = type("Sub", (base,), {})()
    with pytest.raises(TypeError, match="cannot cross"):
        codec.encode(value)
    with pytest.raises(TypeError, match="cannot cross"):
        codec.encode([1, {"key": (value,)}])  # nested as well


def test_codec_decoding_is_bounded_in_time_and_by_hash_collisions():
    colliding = codec.encode({k * (2**61 - 1) for k in range(codec.MAX_EQUAL_HASHES + 1)})  # all hash to 0
    with pytest.raises(ValueError, match="with one hash"):
        codec.decode(colliding)
    fine = codec.encode({k * (2**61 - 1) for k in range(codec.MAX_EQUAL_HASHES)} | set(range(1, 200)))
    assert len(codec.decode(fine)) == codec.MAX_EQUAL_HASHES + 199
    many = codec.encode([[i] for i in range(20000)])
    assert len(codec.decode(many, max_seconds=10.0)) == 20000  # the cap, not the machine, decides below
    with pytest.raises(ValueError, match="too long to decode"):
        codec.decode(many, max_seconds=0.0)


def test_oversized_and_slow_replies_fail_only_their_test_and_fast():
    code = (
        "import os, json\n"
        "def big():\n    return 'x' * (2 << 20)\n"
        "def colliding():\n    return {k * (2**61 - 1) for k in range(4000)}\n"
        "def raw(size):\n"  # a frame written straight to the checker's pipe, larger than any reply may be
        "    body = json.dumps({'value': ['S', 'y' * size]}).encode()\n"
        "    for fd in range(3, 20):\n"
        "        try:\n            os.write(fd, len(body).to_bytes(4, 'big') + body)\n"
        "        except OSError:\n            pass\n"
        "    return 0\n"
        "def fine(x):\n    return x\n"
    )
    started = time.monotonic()
    result = run_python(
        code,
        ["big()", "colliding()", "raw(3_500_000)", "assert fine(4) == 4"],
        timeout=6.0,
    )
    assert result.test_passed == [False, False, False, True], result.errors
    assert "exceeds" in result.errors[0] and "one hash" in result.errors[1]
    assert time.monotonic() - started < 4.0


def test_big_plain_globals_do_not_break_loading():
    code = "TABLE = list(range(100_000))\nSMALL = 3\ndef f():\n    return SMALL\n"  # TABLE: about 1.4 MB encoded
    result = run_python(code, ["assert f() == 3", "assert SMALL == 3", "assert len(TABLE) > 0"], timeout=10.0)
    assert result.test_passed == [True, True, False], result.errors  # TABLE stays in the child
    assert "NameError" in result.errors[0]


def test_error_messages_are_printable_single_lines():
    code = "def f():\n    raise ValueError('a\\nb\\ud800\\x00' + 'z' * 500)\n"
    result = run_python(code, ["f()", "for i in range(2):\n    assert f() == i"])
    assert result.passed == 0 and len(result.errors) == 2
    for error in result.errors:
        error.encode("utf-8")
        assert error.isprintable() and len(error) <= sandbox.MAX_ERROR_CHARS
    assert "a\\nb\\ud800\\x00zz" in result.errors[0]


@ISOLATED
def test_the_process_that_ends_the_run_is_out_of_reach():
    """The candidate runs as PID 1 of its namespace; the process that kills it at the end of the run is outside
    (parent pid 0), and a kill of every process the code may signal reaches neither it nor the checker."""
    code = """
import os, signal
def attack():
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    return [os.getpid(), os.getppid(), sorted(int(name) for name in os.listdir('/proc') if name.isdigit())]
def alive():
    return 'yes'
"""
    result = run_python(code, ["assert attack() == [1, 0, [1]]", "assert alive() == 'yes'"])
    assert result.passed == 2, result.errors


@pytest.mark.parametrize("mode", ["namespaces", "fallback"])
def test_no_process_outlives_a_checker_that_dies_mid_run(mode):
    """The trainer is killed while a run's processes (which cleared their parent-death signals) are alive."""
    if mode == "namespaces" and isolation_mode() != "namespaces":
        pytest.skip("needs Linux namespaces (root)")
    tag = f"sbx{secrets.token_hex(5)}"
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(10**6):06d}"
    script = f"""
import os, sys, warnings
sys.path.insert(0, {ROOT!r})
warnings.simplefilter("ignore")
from comlrl_trl.tasks import sandbox
from comlrl_trl.tasks.sandbox import checker
if {mode!r} == "fallback":
    checker._DISABLED.append("none: forced by the test")
    os.environ[sandbox.ALLOW_UNISOLATED_ENV] = "1"
sandbox.RunCgroup.create = classmethod(lambda cls, *args: None)
sandbox.run_python({SURVIVOR.format(tag=tag, marker=marker)!r}, ["survive()"], timeout=60)
"""
    checker = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE)  # no marker in its command line
    checker.stdin.write(script.encode())
    checker.stdin.close()
    try:
        deadline = time.monotonic() + 20.0
        while len(_live(tag, marker)) < 2 and time.monotonic() < deadline:  # the first process and the sleeper
            time.sleep(0.05)
        assert len(_live(tag, marker)) == 2
    finally:
        checker.kill()
        checker.wait()
    deadline = time.monotonic() + 3.0
    while _live(tag, marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live(tag, marker) == []


# ----- every process a run starts is reaped (issue 55) -----

SUBREAPER_RUNS = """
import ctypes, json, os, sys, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
from comlrl_trl.tasks import sandbox
from comlrl_trl.tasks.sandbox import checker
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: like a trainer that is PID 1
{prelude}
code = "import os, time\\nfor _ in range(3):\\n    if os.fork() == 0:\\n        time.sleep(60)\\n"
code += "def spin():\\n    while True:\\n        pass\\n"
timed_out = sum(sandbox.run_python(code, ["spin()"], timeout={timeout}).timed_out for _ in range({runs}))
me, left = os.getpid(), []
for name in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{{name}}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        continue
    if int(fields[1]) == me:
        left.append((int(name), fields[0].decode()))
print(json.dumps({{"timed_out": timed_out, "left": left}}))
"""


# The process that ends a run does not answer: the checker SIGKILLs it after REAPER_SECONDS.
STUCK = """
import signal
checker.REAPER_SECONDS = 0.2
stop = checker._Child.stop
def stuck_stop(child):
    os.kill(child.process.pid, signal.SIGSTOP)
    stop(child)
checker._Child.stop = stuck_stop
"""


@ISOLATED
@pytest.mark.parametrize("prelude, runs", [("", 50), (STUCK, 10)], ids=["ended", "ending process stuck"])
def test_runs_that_hit_the_time_limit_leave_no_process_to_a_subreaper(prelude, runs):
    """A trainer that is PID 1 of a container or a child subreaper inherits every orphan of the run: after 50 runs
    stopped at their time limit (each forked sleepers), it has no zombie and no live process left (each run used
    to leave the namespace's PID 1 behind as a zombie); nor after 10 runs whose ending process was stuck, so that
    the checker killed it (its child, PID 1 of the namespace, was left as a zombie)."""
    script = SUBREAPER_RUNS.format(root=ROOT, prelude=prelude, timeout=0.3, runs=runs)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == {"timed_out": runs, "left": []}
