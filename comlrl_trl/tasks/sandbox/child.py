"""The untrusted side of `comlrl_trl.tasks.sandbox`: isolate this process, load the candidate program, serve calls.

The checker runs this file as `python -I -S child.py CONFIG` (CONFIG: JSON from `checker._Session`), with
requests on fd 0, replies on fd 1 (length-prefixed JSON, see `codec`) and stderr to a file. Before it
reads any candidate code it:

1. joins the run's cgroups, when the checker made them (memory and process count of the whole process tree);
2. with `isolate`: enters a new PID namespace and forks; PID 1 enters new mount, network, IPC and UTS namespaces.
   The first process stays outside the namespaces, runs no candidate code, waits and relays the exit status; on
   SIGTERM (the checker's way to end the run, also its parent-death signal) it SIGKILLs PID 1, and the kernel
   kills every process of the namespace with it, whatever they did to their parent-death signal, session or
   process group; it reaps PID 1 before it exits, so no zombie is left to the checker (which matters where the
   trainer is PID 1 or a subreaper). The second is PID 1 of the new PID namespace and gets the parent-death
   signal SIGKILL. It builds a new root: a read-only tmpfs holding read-only, nosuid bind mounts of /usr (with
   the /bin, /lib, ... links), the Python standard library and a few devices, with empty directories over every
   site-packages in it (installed packages and their data are not needed: the child runs with -S), a fresh
   /proc, and a small writable tmpfs on /tmp, its working directory. It chroots there, sets the resource limits
   and drops to the run's unprivileged uid, without supplementary groups and with `no_new_privs`;
3. without `isolate`, or where the kernel refuses a new namespace (the fallback): forks; the first process is a
   `reaper`, a child subreaper on Linux (orphans of the run are re-parented to it, not to init) that kills every
   process below it when the server exits or SIGTERM arrives; the server sets the resource limits and disables
   Python-level sockets only. (The candidate code runs as the same user there, so it can kill the reaper first:
   the fallback is not a security boundary, see `checker.py`.)

Its first reply, written before any candidate code runs, says which of 2. and 3. holds. Then it executes the
candidate code, reports the names it defines, and answers `call` requests with plain data. Everything after the
first reply may be forged by the candidate code: the checker relies on none of it for the verdict; the one
thing it takes from there is `Watch`'s evidence for the structure bonus (see there).
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
import types


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import codec  # noqa: E402  (this file runs as a script, outside the package: codec.py lies beside it)


del sys.path[0]
STDLIB = [path for path in sys.path if os.path.exists(path)]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
DEVICES = ("null", "zero", "urandom", "random")
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr links, or real directories
MAX_MESSAGE_CHARS = 200
CO_OPTIMIZED = 0x0001  # set for the code of functions, not for class bodies or modules
_libc = ctypes.CDLL(None, use_errno=True)
_settrace = sys.settrace  # taken before any candidate code runs, which may replace `sys.settrace`
_FUNCTION = types.FunctionType  # and `types.FunctionType`


# ----- isolation (trusted: runs before the candidate code) -----


def _libc_call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags: int, data=None) -> None:
    def raw(text):
        return None if text is None else os.fsencode(text)

    _libc_call("mount", raw(source), raw(target), raw(fstype), ctypes.c_ulong(flags), raw(data))


def _prctl(option: int, value: int) -> None:
    _libc_call("prctl", option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _bind_readonly(source: str, target: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    _mount(source, target, None, MS_BIND)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)


def enter_namespaces() -> int:
    """Unshare and fork. Returns (in PID 1 of the new namespace) the read end of a pipe that closes with the parent.

    The first process never returns and runs no candidate code: it waits for PID 1 and exits with its status; on
    SIGTERM (from the checker, or as its parent-death signal when the checker dies) it SIGKILLs PID 1, which makes
    the kernel kill every process of the namespace, and waits for PID 1 (reaped only once the others are). PID 1
    runs the candidate code and may clear its own parent-death signal or leave its session, but it cannot block a
    SIGKILL from its parent namespace, nor signal its parent (another namespace, another uid)."""
    _libc_call("unshare", CLONE_NEWPID)  # for the children; PID 1 makes the other namespaces (`private_namespaces`)
    lifeline, keep = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until the handler below knows PID 1
    pid = os.fork()
    if pid:

        def end_run(*_):
            try:
                os.kill(pid, signal.SIGKILL)  # cannot be blocked
                os.waitpid(pid, 0)  # returns once the kernel has killed and reaped the whole namespace
            except (ProcessLookupError, ChildProcessError):  # already reaped by the wait below
                pass
            os._exit(1)

        signal.signal(signal.SIGTERM, end_run)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        for fd in (0, 1, lifeline):  # the checker sees EOF as soon as PID 1 is gone
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        os._exit(_exit_code(status))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.close(keep)
    return lifeline


def private_namespaces() -> None:
    """New mount, network, IPC and UTS namespaces for PID 1 (and so the whole run). Made here, not by the first
    process, so that the first process holds none of them: its exit never waits for their teardown."""
    _libc_call("unshare", CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def reaper() -> None:
    """The fallback's reaper. Forks the server: it returns from here (and goes on to serve the checker); this
    process never returns.

    This process runs no candidate code. It is a child subreaper (on Linux), so every process the run leaves is
    re-parented to it, not to init; when the server exits or SIGTERM arrives (from the checker, or as the
    parent-death signal when the checker dies) it kills all of them and exits with the server's status.
    """
    if sys.platform.startswith("linux"):  # orphans of the run come here, not to init
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until this process knows the server's pid
    server = os.fork()
    if server == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if sys.platform.startswith("linux"):
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dropping the uid clears it: set again there
        if os.getppid() != parent:  # the reaper died before the line above
            os._exit(1)
        return

    def finish(status):
        kill_descendants(server)
        os._exit(1 if status is None else _exit_code(status))

    signal.signal(signal.SIGTERM, lambda *_: finish(None))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    for fd in (0, 1):  # only the server holds the checker's pipes
        os.close(fd)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            finish(None)
        if pid == server:
            finish(status)


def kill_descendants(server: int) -> None:
    """SIGKILL the server and every process re-parented to this one, until none is left (at most 2 s)."""
    for pid in (server, *_children()):
        _kill(pid)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        while True:  # reap what has exited
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                return
        children = _children()
        if not children and not os.path.isdir("/proc/self"):  # no /proc: only the server's process group
            return
        for pid in children:
            _kill(pid)
        time.sleep(0.001)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children() -> list[int]:
    """The pids whose parent is this process, from /proc (empty without it)."""
    me, found = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 1 and int(fields[1]) == me:
                found.append(int(name))
    return found


def build_root(root: str, uid: int, tmp_bytes: int, hidden: list[str]) -> None:
    """A new root file system in `root`, read-only except a tmpfs on /tmp, with `hidden` directories (and the
    standard library's site-packages) emptied; chroot into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    exposed = []

    def expose(path):
        if os.path.exists(path) and not any(path == done or path.startswith(done + "/") for done in exposed):
            os.makedirs(root + path if os.path.isdir(path) else os.path.dirname(root + path), exist_ok=True)
            if not os.path.isdir(path):
                open(root + path, "wb").close()
            _bind_readonly(path, root + path)
            exposed.append(path)

    expose("/usr")
    for name in ROOT_LINKS:
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), f"{root}/{name}")
        else:
            expose("/" + name)
    stdlib = [os.path.realpath(path) for path in STDLIB]
    for path in stdlib:
        expose(path)
    for path in hidden + [os.path.join(path, name) for path in stdlib for name in ("site-packages", "dist-packages")]:
        path = os.path.realpath(path)  # installed packages (maybe this one, its tests, data sets): an empty dir
        if os.path.isdir(root + path) and not any(lib == path or lib.startswith(path + "/") for lib in stdlib):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    os.mkdir(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "wb").close()
        _bind_readonly(f"/dev/{name}", f"{root}/dev/{name}", MS_NOSUID | MS_NOEXEC)
    os.mkdir(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + "/tmp")
    _mount(
        "tmpfs",
        root + "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        f"mode=700,uid={uid},gid={uid},size={tmp_bytes}",
    )
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/tmp")


def set_limits(config: dict, processes: bool) -> None:
    limits = [
        (resource.RLIMIT_AS, config["memory_bytes"]),
        (resource.RLIMIT_CPU, config["cpu_seconds"]),
        (resource.RLIMIT_FSIZE, config["file_bytes"]),
        (resource.RLIMIT_NOFILE, config["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    if processes:  # counts the processes of the real uid: meaningful only after dropping to the run's own uid
        limits.append((resource.RLIMIT_NPROC, config["processes"]))
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))


def drop_privileges(uid: int, lifeline: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # set after the uid change, which clears it
    if select.select([lifeline], [], [], 0)[0]:  # the first process died before the line above
        os._exit(1)


def block_network() -> None:
    """The fallback's guard against accidents only: candidate code can undo it (e.g. via subprocess or ctypes)."""
    import _socket
    import socket

    def no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    for module in (socket, _socket):
        for name in (
            "socket",
            "SocketType",
            "socketpair",
            "fromfd",
            "create_connection",
            "create_server",
            "getaddrinfo",
            "gethostbyname",
            "gethostbyname_ex",
            "gethostbyaddr",
        ):
            if hasattr(module, name):
                setattr(module, name, no_network)


def isolate(config: dict) -> str:
    """Apply the isolation of the module docstring; returns how this process is isolated."""
    if sys.platform.startswith("linux"):  # the run ends (see enter_namespaces and reaper) if the checker dies
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != config["checker"]:
            os._exit(1)
    for path in config["cgroups"]:
        with open(path, "w") as handle:
            handle.write(str(os.getpid()))
    if config["isolate"]:
        try:
            lifeline = enter_namespaces()
        except OSError as error:  # no namespaces on this system (or not allowed here): the fallback
            reason = f"unshare failed ({error.strerror})"
        else:
            try:
                private_namespaces()
                build_root(config["root"], config["uid"], config["tmp_bytes"], config["hidden"])
                set_limits(config, processes=True)
                drop_privileges(config["uid"], lifeline)
            except OSError as error:
                return f"failed: {error}"
            return "namespaces"
    else:
        reason = "disabled"
    reaper()
    set_limits(config, processes=False)
    block_network()
    return "none: " + reason


# ----- serving the checker (the candidate code runs from here on) -----


class Sink:
    """Swallows what the candidate prints through sys.stdout / sys.stderr."""

    def write(self, text):
        return len(text)

    def flush(self):
        pass


def send(fd: int, message: dict) -> None:
    codec.write_all(fd, codec.frame(message))


def receive(fd: int) -> dict:
    size = int.from_bytes(codec.read_exact(fd, 4), "big")
    return codec.parse(codec.read_exact(fd, size))


def message(error: BaseException) -> str:
    try:
        return str(error)[:MAX_MESSAGE_CHARS]
    except BaseException:  # a candidate-defined __str__ may fail
        return ""


class Watch:
    """The evidence behind `run_python(..., watch=(caller, callee))`: whether a call of `caller` that the checker
    asked for ran the program's own `def caller` (its code object, compiled here from the candidate's top-level
    `def`, not a decorator's wrapper or a replaced `__code__`) and, inside it, the program's own `def callee` (not
    a function re-bound to that name through `globals()`, a frame's `f_globals` or a star import).

    A trace function (`sys.settrace`, taken before the candidate code loads) runs during such calls only, only
    when the code of `caller` names `callee` at all, and only until `callee`'s code starts. The evidence is positive: code that removes the tracer, runs `callee` in another
    thread or breaks the reply loses it. It is not proof against code written to forge it (this process runs the
    candidate code, which can reach this object or write a reply of its own); the bonus it gates is small."""

    def __init__(self, compiled: types.CodeType, caller: str, callee: str):
        functions = [const for const in compiled.co_consts if isinstance(const, types.CodeType)]
        functions = [code for code in functions if code.co_flags & CO_OPTIMIZED]
        own_callers = [code for code in functions if code.co_name == caller]
        self.caller = caller
        self.caller_code = own_callers[-1] if own_callers else None  # the last `def caller`: the main agent's
        if self.caller_code is not None and not _names(self.caller_code, callee):
            self.caller_code = None  # it cannot call `callee` by name: nothing to trace
        self.callee_codes = {id(code): code for code in functions if code.co_name == callee}
        self.seen = False

    def call(self, name: str, function, args: list, kwargs: dict):
        """`function(*args, **kwargs)`, traced when it is the own `caller`; whether the own `callee` ran is kept."""
        if name != self.caller or type(function) is not _FUNCTION or function.__code__ is not self.caller_code:
            return function(*args, **kwargs)
        ran = []

        def trace(frame, event, arg):
            if event == "call" and self.callee_codes.get(id(frame.f_code)) is frame.f_code:
                ran.append(True)
                _settrace(None)
            return None

        _settrace(trace)
        try:
            return function(*args, **kwargs)
        finally:
            _settrace(None)
            self.seen = self.seen or bool(ran)


def _names(code: types.CodeType, name: str) -> bool:
    """Whether `code`, or a code object nested in it (a comprehension, lambda, inner function), uses `name`."""
    stack = [code]
    while stack:
        code = stack.pop()
        if name in code.co_names:
            return True
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return False


def load(code: str, watch: list | None = None) -> tuple[dict, dict, Watch | None]:
    """Execute the candidate code; returns its namespace, the report (errors and the names it defines) and, with
    `watch` (`[caller, callee]`), the `Watch` of its calls."""
    namespace = {"__name__": "__sandbox__"}
    try:
        compiled = compile(code, "<candidate>", "exec")
    except SyntaxError as error:
        where = f" (line {error.lineno})" if error.lineno else ""
        return namespace, {"syntax_error": f"SyntaxError: {error.msg}{where}"}, None
    except BaseException as error:  # e.g. null bytes in the source
        return namespace, {"syntax_error": f"{type(error).__name__}: {message(error)}"}, None
    watcher = Watch(compiled, *watch) if watch else None
    report = {"error": None, "functions": [], "values": {}}
    try:
        exec(compiled, namespace)
    except BaseException as error:
        report["error"] = f"{type(error).__name__} while running the code: {message(error)}"
    room = codec.MAX_REPLY_BYTES // 2  # plain-data globals that do not fit stay in the child (tests cannot see them)
    for name, value in list(namespace.items()):
        if callable(value):
            report["functions"].append(name)
        else:
            try:
                encoded = codec.encode(value)
                size = len(json.dumps(encoded)) + len(name) + 8
            except (TypeError, ValueError):
                continue  # modules and other objects stay in the child
            if size <= room:
                room -= size
                report["values"][name] = encoded
    return namespace, report, watcher


def answer(namespace: dict, request: dict, watcher: Watch | None = None) -> dict:
    try:
        name = request["call"]
        function = namespace[name]
        args = [codec.decode(value) for value in request["args"]]
        kwargs = {key: codec.decode(value) for key, value in request["kwargs"].items()}
        value = watcher.call(name, function, args, kwargs) if watcher else function(*args, **kwargs)
        reply = {"value": codec.encode(value)}
        codec.frame(reply, codec.MAX_REPLY_BYTES)  # too large to send?
    except BaseException as error:
        reply = {"raise": [type(error).__name__, message(error)]}
    if watcher is not None and watcher.seen:
        reply["watched"] = True
    return reply


def main() -> None:
    config = json.loads(sys.argv[1])
    isolation = isolate(config)
    requests, replies = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    send(replies, {"isolation": isolation})
    if isolation.startswith("failed"):
        os._exit(1)
    sys.stdout = sys.stderr = Sink()
    request = receive(requests)
    namespace, report, watcher = load(request["code"], request.get("watch"))
    send(replies, report)
    while True:
        try:
            request = receive(requests)
        except EOFError:
            os._exit(0)
        send(replies, answer(namespace, request, watcher))


if __name__ == "__main__":
    main()
