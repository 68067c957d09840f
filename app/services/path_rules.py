"""Rules for local paths in a request: they must exist and lie under the allowed roots."""

from __future__ import annotations

import re
from pathlib import Path

from app.errors import field_problem
from app.schemas.run_request import RunRequest
from worker.data import LOCAL_BUILDERS, is_local_source

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def local_path_problems(request: RunRequest, *, allowed_roots: list[Path]) -> list[dict[str, str]]:
    problems = []
    for field, value in (("model", request.model), ("dataset.source", request.dataset.source)):
        if _URL.match(value):
            problems.append(
                field_problem(field, f"{value!r} is a URL; give a hub id or a local path")
            )
            continue
        if not is_local_source(value):
            continue  # a hub id; it is resolved on the cluster
        message = _check_local(value, allowed_roots)
        if message is None and field == "dataset.source":
            message = _check_dataset_file(Path(value).expanduser().resolve())
        if message:
            problems.append(field_problem(field, message))
    return problems


def _check_local(value: str, allowed_roots: list[Path]) -> str | None:
    path = Path(value).expanduser()
    if not path.exists():
        return f"local path {value!r} does not exist"
    # resolve() follows symlinks and '..', so neither can step outside an allowed root.
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in allowed_roots):
        roots = ", ".join(str(r) for r in allowed_roots)
        return (
            f"local path {value!r} is outside the allowed roots ({roots}); "
            "see TUNEYARD_ALLOWED_ROOTS"
        )
    return None


def _check_dataset_file(path: Path) -> str | None:
    if path.is_file() and path.suffix not in LOCAL_BUILDERS:
        return f"dataset file {path.name!r} must be one of {', '.join(sorted(LOCAL_BUILDERS))}"
    return None
