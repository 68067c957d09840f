"""Which paths a request may name, and which a run's worker may post: one rule each.

A request names local paths (`model`, `dataset.source`, `dataset.eval_source`; the OpenAI
routes and validate build the same request) that must lie inside the operator's allowed
roots, and never in the service's own folders inside them (`SourceRoots.refused`): its
storage, which holds every run's checkpoints and exports, the uploads and the profiles,
and its state. What is in storage belongs to one API key and is reached through an id
that checks the owner: an upload by its file id, an earlier run's export by its run id
(app/services/rules/run_rules.py). A path is compared as written (`..` applied) and as its real
path (every link followed), so neither a link nor `..` leads around the rule.

A run's worker posts where it wrote its checkpoints and exports. Those locations must lie
under storage/<run id>/, where Ray Train (RunConfig(name=run id)) and the export
(worker/model/checkpoints.py) write them, so that the run's model download and a later
`model: <run id>` read that run's files and no one else's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from contract.storage import Storage, is_uri

# The service's own folders, by what they hold: a refusal names which (below).
ServiceFolder = Literal["uploads", "storage", "state"]


class SourceRoots(list[Path]):
    """The folders a run may read a local model or dataset from (the list itself), and the
    service's own folders it may never read from, whatever the list says (`refused`, the
    most specific first): its uploads and the rest of its storage (every run's checkpoints
    and exports, profiles), each an API key's own and reached through a file or run id that
    only its owner can use, and its state. A list, so that callers which only know the
    allowed roots keep working. The rules below apply it; Settings.resolved_allowed_roots
    makes it."""

    def __init__(
        self, allowed: Iterable[Path], *, refused: Mapping[Path, ServiceFolder] | None = None
    ) -> None:
        super().__init__(allowed)
        self.refused: dict[Path, ServiceFolder] = dict(refused or {})


# A local folder source is walked to check every file in it; one bigger than this is
# refused rather than walked for minutes inside a request.
MAX_FOLDER_ENTRIES = 10_000

# What each of the service's folders is called in a refusal, and the way in instead.
_FOLDER_NAMES: dict[ServiceFolder, str] = {
    "uploads": "the service's uploads folder",
    "storage": "the service's storage",
    "state": "the service's state folder",
}
_WAYS_IN: dict[ServiceFolder, str] = {
    "uploads": "an uploaded file is used through its id (dataset.source 'file_...'), by its "
    "owner only",
    "storage": "it holds runs' checkpoints and exports, each an API key's own; an earlier run's "
    "exported model is used through the run's id (model 'run_...'), by its owner only",
    "state": "it is the service's own, no run's to read",
}


def allowed_local_path(value: str, roots: Sequence[Path]) -> tuple[Path | None, str | None]:
    """A request's local path (`value`, as written) as its real path (every link followed)
    and None; or None and why not, in words that name the rule.

    A path is refused as outside the roots before the file system is asked whether it
    exists, so the answer never says what lies outside them; only a path inside the roots
    can get "does not exist". A folder is walked: no file in it may lead outside either,
    nor into the service's folders. `roots`: a `SourceRoots` names those folders."""
    refused = roots.refused if isinstance(roots, SourceRoots) else {}
    listed = ", ".join(str(r) for r in roots)
    shown = _shown(value)

    def refusal(path: Path) -> str | None:
        if not _inside(path, roots):
            return (
                f"local path {shown} is outside the allowed roots ({listed}); see "
                "TUNEYARD_ALLOWED_ROOTS"
            )
        if (folder := service_folder(path, refused)) is not None:
            return (
                f"local path {shown} is in {_FOLDER_NAMES[folder]}, which is not allowed: "
                f"{_WAYS_IN[folder]}"
            )
        return None

    # First as written, '..' applied without asking the file system anything about it...
    written = Path(os.path.normpath(Path(value).absolute()))
    if message := refusal(written):
        return None, message
    # ...then with every link followed (non-strict: no error for a missing part), so that
    # no link inside a root leads out of it, nor into the service's folders.
    real = Path(os.path.realpath(written))
    if message := refusal(real):
        return None, message
    try:
        if not real.exists():
            return None, f"local path {shown} does not exist"
        if real.is_dir():
            if message := _folder_problem(real, roots, refused):
                return None, f"local path {shown}: {message}"
        elif not real.is_file():
            return None, f"local path {shown} is neither a file nor a folder"
    except (OSError, RuntimeError) as exc:
        # ENAMETOOLONG, ELOOP, EACCES...: the user's to fix, never a server error.
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return None, f"local path {shown} cannot be read: {reason}"
    return real, None


def service_folder(path: Path, refused: Mapping[Path, ServiceFolder]) -> ServiceFolder | None:
    """Which of the service's folders holds `path` (the most specific first), or None."""
    return next((kind for folder, kind in refused.items() if path.is_relative_to(folder)), None)


def _folder_problem(
    folder: Path,
    roots: Sequence[Path],
    refused: Mapping[Path, ServiceFolder],
    *,
    outside: str = "the allowed roots",
) -> str | None:
    """Why a folder source may not be read (an entry leads outside the roots or into the
    service's folders, or there are too many to check), or None. `folder` is a real path.
    Links are followed, each real folder walked once, so a link cycle ends the walk
    instead of looping."""
    seen = {folder}
    pending = [(folder, folder)]  # (a folder as reached, its real path)
    entries = 0
    while pending:
        current, current_real = pending.pop()
        with os.scandir(current) as listing:
            for entry in listing:
                entries += 1
                if entries > MAX_FOLDER_ENTRIES:
                    return f"the folder holds more than {MAX_FOLDER_ENTRIES} files and folders"
                if entry.is_symlink():
                    real = Path(os.path.realpath(entry.path))
                    is_dir = real.is_dir()
                else:
                    # Not a link, in a folder whose real path is known: that is its real
                    # path too. Only links cost a walk of the path (a model folder's files
                    # are checked on every validate and create).
                    real = current_real / entry.name
                    is_dir = entry.is_dir(follow_symlinks=False)
                if not _inside(real, roots):
                    return f"{_entry_name(entry, folder)} in it leads outside {outside}"
                if (kind := service_folder(real, refused)) is not None:
                    return f"{_entry_name(entry, folder)} in it leads into {_FOLDER_NAMES[kind]}"
                if is_dir and real not in seen:
                    seen.add(real)
                    pending.append((Path(entry.path), real))
    return None


# -- what a run's worker posts ------------------------------------------------------------


def run_location(storage: Storage, run_id: str, location: str) -> tuple[str | None, str | None]:
    """A location a run's worker posted (a checkpoint, an export), normalized, and None; or
    None and why it is not the run's own. It must lie below storage/<run id>/: on a local
    folder as written and as its real path (a link there may lead nowhere else); in an
    object store, with no empty, `.` or `..` part."""
    folder = storage.join(run_id)
    shown = _shown(location)
    refused = f"{shown} is not inside this run's folder in storage ({folder}/)"
    if storage.remote:
        trimmed = location.rstrip("/")
        if not trimmed.startswith(folder + "/"):
            return None, refused
        if any(part in ("", ".", "..") for part in trimmed[len(folder) + 1 :].split("/")):
            return None, refused  # an object store keeps `..` as a name; a reader may not
        return trimmed, None
    if not location.startswith("/"):
        return None, f"{shown} is not an absolute path"
    written = os.path.normpath(location)
    # The root's real path, the run's folder under it by name: a run folder that is itself
    # a link leads out of it too.
    real_folder = Path(os.path.realpath(storage.root), run_id)
    real = Path(os.path.realpath(written))
    for path, inside in ((Path(written), Path(folder)), (real, real_folder)):
        if path == inside or not path.is_relative_to(inside):
            return None, refused
    return written, None


def export_problem(location: str) -> str | None:
    """Why a run's exported model folder (local) may not be read as the run's own, or None:
    one of its entries is a link leading out of it. The download leaves such links out; a
    `model: <run id>` and the worker loading it would follow them, into another run's
    files."""
    if is_uri(location):
        return None  # an object store has no links
    real = Path(os.path.realpath(location))
    try:
        if not real.is_dir():
            return None
        return _folder_problem(real, [real], {}, outside="the exported folder")
    except (OSError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"cannot be read: {reason}"


def _entry_name(entry: os.DirEntry[str], folder: Path) -> str:
    return _shown(os.path.relpath(entry.path, folder))


def _inside(path: Path, folders: Sequence[Path]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def _shown(value: str, limit: int = 200) -> str:
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."
