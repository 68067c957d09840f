"""Python graders are untrusted code: each escape a grader might try ends as a grader
error (or a harmless score) while the caller goes on. Real sandboxes, real processes:
bubblewrap must be installed (apt-get install bubblewrap, as .ci/run does)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.graders.grading import PythonGraderFailed, Runners, grade
from contract.graders.models import PythonGrader
from contract.graders.sandbox import SANDBOX_UIDS, PythonSandbox, SandboxLimits
from contract.graders.templates import Sample

# The limits are the defaults' in kind (the defaults themselves: test_the_defaults_are_
# openais). A grader that should finish gets a minute: on a loaded 2-core machine a
# sandboxed Python that imports rapidfuzz took over 5 s of wall time (this suite's CI).
LIMITS = SandboxLimits(timeout_s=60.0, memory_bytes=512 * 1024**2, max_processes=16)
# The time-limit tests' own: short enough that the endless loop costs the suite seconds.
SHORT = SandboxLimits(timeout_s=5.0, memory_bytes=512 * 1024**2, max_processes=16)


def _has_bwrap() -> None:
    assert shutil.which("bwrap"), "install bubblewrap (apt-get install bubblewrap), as .ci/run does"


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    _has_bwrap()
    return PythonSandbox(LIMITS)


@pytest.fixture(scope="module")
def short_sandbox() -> PythonSandbox:
    _has_bwrap()
    return PythonSandbox(SHORT)


def python(source: str) -> PythonGrader:
    return PythonGrader(type="python", name="untrusted", source=source)


def run(sandbox: PythonSandbox, source: str, item: object = None) -> float:
    return sandbox(python(source), Sample.of('{"answer": 42}'), item or {})


def refused(sandbox: PythonSandbox, source: str) -> str:
    """What the sandbox said when it ended the grader."""
    with pytest.raises(PythonGraderFailed) as failed:
        run(sandbox, source)
    assert not failed.value.server
    return failed.value.details


def test_a_grader_reads_the_sample_and_the_item(sandbox: PythonSandbox) -> None:
    source = (
        "def grade(sample, item):\n"
        "    right = sample['output_json']['answer'] == item['answer']\n"
        "    return 1.0 if right and sample['output_text'].startswith('{') else 0.0\n"
    )
    assert run(sandbox, source, {"answer": 42}) == 1.0
    assert run(sandbox, source, {"answer": 41}) == 0.0


def test_what_it_prints_is_not_taken_for_the_score(sandbox: PythonSandbox) -> None:
    source = "def grade(sample, item):\n    print('{\"score\": 99}')\n    return 0.25\n"
    assert run(sandbox, source) == 0.25


def test_an_exception_is_a_runtime_error_with_its_traceback(sandbox: PythonSandbox) -> None:
    details = refused(sandbox, "def grade(sample, item):\n    return 1 / 0\n")
    assert "ZeroDivisionError" in details


@pytest.fixture
def service_port() -> Iterator[int]:
    """A port the host listens on, as the service's does."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.1)
        accepted: list[object] = []
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(server.accept())
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield server.getsockname()[1]
        stop.set()
        thread.join()
        assert accepted == [], "the grader reached the host's port"


def test_no_network_not_even_the_hosts_loopback(sandbox: PythonSandbox, service_port: int) -> None:
    details = refused(
        sandbox,
        "import socket\n"
        "def grade(sample, item):\n"
        f"    socket.create_connection(('127.0.0.1', {service_port}), timeout=2)\n"
        "    return 1.0\n",
    )
    assert "ConnectionRefusedError" in details
    details = refused(
        sandbox,
        "import socket\n"
        "def grade(sample, item):\n"
        "    socket.create_connection(('1.1.1.1', 443), timeout=2)\n"
        "    return 1.0\n",
    )
    assert "Network is unreachable" in details


def test_the_services_files_are_not_there(sandbox: PythonSandbox, tmp_path: Path) -> None:
    database = tmp_path / "tuneyard.db"
    database.write_text("secret rows")
    for path in (database, Path(__file__), Path.home() / ".bash_history", Path("/etc/passwd")):
        details = refused(
            sandbox, f"def grade(sample, item):\n    return len(open({str(path)!r}).read())\n"
        )
        assert "FileNotFoundError" in details, path


def test_the_environment_is_not_the_services(
    sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNEYARD_DATABASE_URL", "postgresql://user:secret@db/tuneyard")
    source = (
        "import os\n"
        "def grade(sample, item):\n"
        "    leaked = [k for k, v in os.environ.items() if 'secret' in v or 'TUNEYARD' in k]\n"
        "    return float(len(leaked)) + len(os.environ) / 1000\n"
    )
    score = run(sandbox, source)
    assert score < 1.0  # nothing leaked; a few variables of the sandbox's own
    # /proc is the sandbox's own: no process of the host to read an environment from.
    source = (
        "import os\n"
        "def grade(sample, item):\n"
        "    return float(sum(1 for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    assert run(sandbox, source) <= 3


def test_writing_outside_its_temp_dir_fails(sandbox: PythonSandbox) -> None:
    for path in ("/usr/grader", "/grader", f"{Path(__file__).parent}/grader"):
        details = refused(
            sandbox, f"def grade(sample, item):\n    open({path!r}, 'w').write('x')\n    return 1\n"
        )
        assert (
            "Read-only file system" in details
            or "No such file" in details
            or ("Permission denied" in details)
        ), details
        assert not Path(path).exists()
    # Its own /tmp it may use.
    source = (
        "def grade(sample, item):\n"
        "    open('/tmp/scratch', 'w').write('x' * 10)\n"
        "    return float(len(open('/tmp/scratch').read()))\n"
    )
    assert run(sandbox, source) == 10.0


def test_memory_in_files_is_bounded_by_the_files_it_may_hold(sandbox: PythonSandbox) -> None:
    # memfd and /tmp count in no address-space limit: 16 open files of 64 MB at most.
    details = refused(
        sandbox,
        "import os\n"
        "def grade(sample, item):\n"
        "    for _ in range(40):\n"
        "        fd = os.memfd_create('x')\n"
        "        os.write(fd, b'A' * (1 << 20))\n"
        "    return 1.0\n",
    )
    assert "Too many open files" in details


def test_the_grader_runs_as_a_user_of_its_own(sandbox: PythonSandbox) -> None:
    source = "import os\ndef grade(sample, item):\n    return float(os.getuid())\n"
    uids = {run(sandbox, source) for _ in range(3)}
    assert all(uid >= 1000 for uid in uids)
    if os.getuid() == 0:  # root's sandbox picks one per call from a range no account uses
        assert all(uid in SANDBOX_UIDS for uid in uids) and len(uids) > 1


def test_the_services_installed_packages_are_there_read_only(sandbox: PythonSandbox) -> None:
    # OpenAI's own example grader imports rapidfuzz.
    source = (
        "from rapidfuzz import fuzz, utils\n"
        "def grade(sample, item):\n"
        "    return fuzz.WRatio(sample['output_text'], item['answer'], "
        "processor=utils.default_process) / 100.0\n"
    )
    assert sandbox(python(source), Sample.of("Paris"), {"answer": "paris"}) == 1.0
    # Its own code is not among them.
    details = refused(sandbox, "import app.settings\ndef grade(sample, item):\n    return 1\n")
    assert "No module named 'app'" in details


def test_a_grader_killed_by_a_signal_says_so(sandbox: PythonSandbox) -> None:
    details = refused(
        sandbox,
        "import os, signal\ndef grade(sample, item):\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
    )
    assert "crashed (SIGSEGV)" in details


def test_what_it_writes_past_the_runner_is_no_number(sandbox: PythonSandbox) -> None:
    for junk in (b"[" * 4000, b'{"score": 1' + b"0" * 400 + b"}"):
        details = refused(
            sandbox,
            f"import os\ndef grade(sample, item):\n    os.write(1, {junk!r})\n    os._exit(0)\n",
        )
        assert "gave no number" in details


def test_a_fork_bomb_ends_as_an_error(sandbox: PythonSandbox) -> None:
    details = refused(
        sandbox, "import os\ndef grade(sample, item):\n    while True:\n        os.fork()\n"
    )
    assert "BlockingIOError" in details or "Resource temporarily unavailable" in details


def test_allocating_10_gb_ends_as_an_error(sandbox: PythonSandbox) -> None:
    details = refused(sandbox, "def grade(sample, item):\n    return len(bytearray(10 * 2**30))\n")
    assert "ran out of memory" in details


def test_an_endless_loop_is_stopped_at_the_time_limit(short_sandbox: PythonSandbox) -> None:
    started = time.monotonic()
    details = refused(short_sandbox, "def grade(sample, item):\n    while True:\n        pass\n")
    assert time.monotonic() - started < SHORT.timeout_s + 10
    assert "was stopped" in details or "CPU time" in details


def test_a_sleeping_grader_is_stopped_too(short_sandbox: PythonSandbox) -> None:
    # Sleeping uses no CPU time: the wall-clock deadline ends it.
    details = refused(short_sandbox, "import time\ndef grade(sample, item):\n    time.sleep(600)\n")
    assert "ran past 5 s" in details


def test_a_failure_is_a_grade_of_zero_with_the_reason(sandbox: PythonSandbox) -> None:
    result = grade(
        python("def grade(sample, item):\n    raise ValueError('no')\n"),
        "x",
        {},
        Runners(python=sandbox),
    )
    assert result.reward == 0.0
    assert result.errors.python_grader_runtime_error
    assert "ValueError: no" in (result.errors.python_grader_runtime_error_details or "")


def test_the_defaults_are_openais() -> None:
    limits = SandboxLimits()
    assert (limits.timeout_s, limits.memory_bytes) == (120.0, 2 * 1024**3)


def test_a_python_installed_under_tmp_stays_visible(sandbox: PythonSandbox) -> None:
    """The empty /tmp is mounted before Python's own folders are bound, so a virtualenv
    under /tmp (a clone in a `mktemp -d` folder) is bound over it, not hidden under it:
    a grader there found none of its packages. (Checked by hand with a venv in /tmp.)"""
    command = sandbox._command
    tmpfs = command.index("--tmpfs")
    binds = [i for i, arg in enumerate(command) if arg == "--ro-bind"]
    assert command[tmpfs + 1] == "/tmp" and binds and tmpfs < min(binds)
