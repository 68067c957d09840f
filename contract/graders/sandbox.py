"""Python graders run here: untrusted code, each call in a process of its own inside a
bubblewrap sandbox (`bwrap`, the tool Flatpak sandboxes with), so that the code sees no
network, no file of the host but the Python it runs on (read-only) and an empty /tmp, no
environment variable of the service, and no process but its own. Within that, OpenAI's
published limits, as defaults: 2 minutes, 2 GB of memory, 1 CPU, code up to 256 kB
(models.py). Whatever the code does (raises, loops, allocates, forks, writes where it may
not) ends as a `PythonGraderFailed`, never as an error of the caller.

The sandboxed interpreter is this process's own base Python with `-I -S`: the standard
library and the packages installed beside the service (numpy, rapidfuzz, ...), read-only.

Why each limit holds:
- network: a network namespace of its own (`--unshare-all`) has only a loopback that is
  down, so no address, the service's included, can be reached;
- files: a mount namespace with the interpreter's prefix, the installed packages and /usr
  bound read-only, a fresh
  /proc (of the sandbox's own PID namespace) and a tmpfs /tmp; the service's home, its
  database and the job's files are not there to open;
- memory and CPU: RLIMIT_AS and RLIMIT_CPU, inherited by everything it starts, and one
  CPU by affinity;
- processes: RLIMIT_NPROC, counted per user; the kernel never applies it to root, so a
  sandbox that root starts runs the grader as a user of its own (a uid picked per call
  from a range no account uses);
- time: a wall-clock deadline on top of the CPU limit (sleeping uses no CPU); at it the
  sandbox's PID 1 is killed, and the kernel kills every process of its namespace with it.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.graders.grading import PythonGraderFailed
from contract.graders.models import PythonGrader
from contract.graders.templates import Sample

# The users a sandbox started by root runs its grader as: one picked at random per call from
# a range no account uses, so that concurrent graders do not share RLIMIT_NPROC's count or
# a kernel keyring (keyrings are per user and outlive the call).
SANDBOX_UIDS = range(2_000_000, 2_065_536)
_OPEN_FILES = 16
# The packages installed beside this service (numpy, rapidfuzz ... as OpenAI's grader image
# has them), read-only; tuneyard's own code is not among them (an editable install's link
# to it is a .pth file, which the sandbox's `python -S` never reads).
_LIBRARIES = sorted(
    {p for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]) if p}
)
# What of a grader's printed output comes back with an error: the end of a traceback.
_DETAILS_CHARS = 2000

# Runs inside the sandbox: the request on stdin; as root (a sandbox started by root) it then
# becomes the request's user, whose processes RLIMIT_NPROC counts (root's it never limits);
# the score goes as JSON to the real stdout, what the grader prints to stderr.
_RUNNER = """
import json, os, sys
request = json.load(sys.stdin)
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(request["uid"])
    os.setuid(request["uid"])
sys.path.extend(request["path"])
result, sys.stdout = sys.stdout, sys.stderr
namespace = {"__name__": "grader"}
exec(compile(request["source"], "grader.py", "exec"), namespace)
score = namespace["grade"](request["sample"], request["item"])
result.write(json.dumps({"score": float(score)}))
result.flush()
"""


class SandboxUnavailable(RuntimeError):
    """Python graders cannot be sandboxed where this runs."""


_TOOLS = ("bwrap", "prlimit", "taskset")


def unavailable() -> str | None:
    """Why Python graders cannot be sandboxed on this machine, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "Python graders run sandboxed on Linux only"
    if any(shutil.which(tool) is None for tool in _TOOLS):
        return (
            "Python graders need bubblewrap (`bwrap`: apt-get install bubblewrap) and "
            "util-linux's prlimit and taskset on every machine that grades"
        )
    return None


@dataclass(frozen=True)
class SandboxLimits:
    """OpenAI's published limits for Python graders, as defaults."""

    timeout_s: float = 120.0
    memory_bytes: int = 2 * 1024**3
    max_processes: int = 32
    # Files the grader writes to /tmp, and what it prints: no grader needs more.
    max_file_bytes: int = 64 * 1024**2


def _binds() -> list[str]:
    """Read-only binds of what the interpreter needs: /usr (and the top-level links into
    it on a merged-/usr system) and Python's own prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        path = Path(top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), top]
        elif path.is_dir():
            args += ["--ro-bind", top, top]
    made: set[Path] = set()
    for path in (Path(sys.base_prefix), *map(Path, _LIBRARIES)):
        if str(path).startswith("/usr/") or not path.is_dir():
            continue
        # The directories above it open to all (bwrap would make them root's alone, and the
        # grader runs as another user where root starts the sandbox): /root/.pyenv/..., say.
        for parent in reversed(path.parents[:-1]):
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", str(path), str(path)]
    return args


def _namespaces() -> list[str]:
    """Every namespace anew. Root's sandbox keeps the user namespace: in a new one root
    could not become another user (only root itself is mapped there)."""
    if os.getuid() != 0:
        return ["--unshare-all"]
    return [
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]


def _python() -> str:
    """The base interpreter, not a virtual environment's link to it: the link's folder is
    not bound, and the runner puts the environment's packages on `sys.path` itself."""
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    return str(base.resolve())


class PythonSandbox:
    """Runs a Python grader in a sandbox; a `PythonRunner` for `grading.grade`."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        reason = unavailable()
        if reason is not None:
            raise SandboxUnavailable(reason)
        bwrap, prlimit, taskset = (str(shutil.which(t)) for t in _TOOLS)
        self._prlimit, self._taskset = prlimit, taskset
        self.limits = limits or SandboxLimits()
        self._command = [
            bwrap,
            *_namespaces(),
            "--die-with-parent",
            "--new-session",
            # Capabilities matter only where root starts the sandbox: the runner's first
            # act is to become another user, which drops these two with the rest.
            "--cap-drop",
            "ALL",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
            # The empty /tmp first: a Python installed under /tmp (a virtualenv there)
            # is bound on top of it, where a tmpfs mounted after would hide it.
            "--perms",
            "1777",
            "--size",
            str(self.limits.max_file_bytes),
            "--tmpfs",
            "/tmp",
            *_binds(),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--chdir",
            "/tmp",
            "--clearenv",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--",
            _python(),
            "-I",
            "-S",
            "-c",
            _RUNNER,
        ]

    def _limits(self) -> list[str]:
        """util-linux's prlimit and taskset before bwrap: limits that everything in the
        sandbox inherits (set by commands, not a preexec_fn, which is unsafe in a process
        with threads, as the service is)."""
        limits = self.limits
        cpu_s = math.ceil(limits.timeout_s)
        cpu = random.choice(sorted(os.sched_getaffinity(0)))  # graders at once, spread
        return [
            self._prlimit,
            f"--as={limits.memory_bytes}",
            f"--cpu={cpu_s}:{cpu_s + 1}",
            f"--fsize={limits.max_file_bytes}",
            # Few files: memory in files (memfd, /tmp) counts in no RLIMIT_AS, so it is
            # bounded by how many files of max_file_bytes a grader can hold open.
            f"--nofile={_OPEN_FILES}",
            "--core=0",
            f"--nproc={self._nproc}",
            self._taskset,
            "--cpu-list",
            str(cpu),
        ]

    @property
    def _nproc(self) -> int:
        """RLIMIT_NPROC counts every process of the user: as root the runner becomes
        a user of its own, who has none; any other user's own processes (the service, Ray's
        workers) count too, so the grader's allowance comes on top of them."""
        if os.getuid() == 0:
            return self.limits.max_processes
        mine = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owned(p))
        return mine + self.limits.max_processes

    def __call__(
        self, grader: PythonGrader, sample: Sample, item: Any, timeout_s: float | None = None
    ) -> float:
        """The grader's score, within `timeout_s` (at most the limits' own)."""
        timeout = min(timeout_s or self.limits.timeout_s, self.limits.timeout_s)
        request = json.dumps(
            {
                "uid": random.choice(SANDBOX_UIDS),
                "path": _LIBRARIES,
                "source": grader.source,
                "sample": {"output_text": sample.output_text, "output_json": sample.output_json},
                "item": item,
            }
        ).encode()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                process = subprocess.Popen(
                    [*self._limits(), *self._command],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            except OSError as error:
                raise PythonGraderFailed(
                    f"the sandbox did not start: {error}", server=True, kind="sandbox"
                ) from None
            timed_out = False
            try:
                process.communicate(request, timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            out.seek(0)
            answer = out.read(4096)
            err.seek(0)
            details = err.read()[-_DETAILS_CHARS * 4 :].decode(errors="replace")[-_DETAILS_CHARS:]
        if timed_out:
            raise PythonGraderFailed(f"the grader ran past {timeout:g} s and was stopped")
        if process.returncode != 0:
            raise PythonGraderFailed(_why(process.returncode, details))
        try:
            return float(json.loads(answer)["score"])
        except (ValueError, KeyError, TypeError, RecursionError, OverflowError):
            # What the grader wrote to stdout itself, past the runner: anything at all.
            raise PythonGraderFailed(f"grade() gave no number: {details}") from None


def _owned(proc: Path) -> bool:
    try:
        return proc.stat().st_uid == os.getuid()
    except OSError:
        return False


def _why(returncode: int, details: str) -> str:
    # bwrap exits 128 + N when the grader died of signal N; a negative code is our own kill.
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if number:
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        meaning = {
            "SIGXCPU": "used its CPU time",
            "SIGXFSZ": "wrote past the file size limit",
            "SIGKILL": "was killed",
            "SIGSEGV": "crashed",
        }.get(name, "was stopped")
        return f"the grader {meaning} ({name}) {details}".strip()
    if "MemoryError" in details:
        return f"the grader ran out of memory (limit reached): {details}"
    return details or f"the grader exited with status {returncode}"
