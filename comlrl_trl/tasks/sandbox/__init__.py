"""The sandbox for model-written Python: `run_python(code, tests)` and what its callers use.

* `checker` (the trusted side, in the calling process): `run_python`, the verdict, the threat model.
* `child` (the untrusted side, run by path as `python -I -S child.py CONFIG`): isolation, the candidate code.
* `codec`: the plain-data wire format both sides share (standard library only: the child loads it by path).
* `cgroup`: a cgroup per run, for memory and process-count limits over the whole process tree.

The names below are `comlrl_trl.tasks.sandbox`'s interface (as when the sandbox was one module); tests that
change the checker's state patch `comlrl_trl.tasks.sandbox.checker` itself.
"""

from .cgroup import RunCgroup
from .checker import (
    ALLOW_UNISOLATED_ENV,
    CHILD,
    CONTROL_FLOW_EXCEPTIONS,
    MAX_ERROR_CHARS,
    MAX_ERRORS,
    MAX_OPEN_FILES,
    MAX_OUTPUT_BYTES,
    MAX_PROCESSES,
    MAX_TMP_MB,
    REAPER_SECONDS,
    CandidateError,
    SandboxResult,
    UnisolatedError,
    compile_tree,
    isolation_mode,
    parse,
    printable,
    run_python,
)


__all__ = [
    "ALLOW_UNISOLATED_ENV",
    "CHILD",
    "CONTROL_FLOW_EXCEPTIONS",
    "MAX_ERRORS",
    "MAX_ERROR_CHARS",
    "MAX_OPEN_FILES",
    "MAX_OUTPUT_BYTES",
    "MAX_PROCESSES",
    "MAX_TMP_MB",
    "REAPER_SECONDS",
    "CandidateError",
    "RunCgroup",
    "SandboxResult",
    "UnisolatedError",
    "compile_tree",
    "isolation_mode",
    "parse",
    "printable",
    "run_python",
]
