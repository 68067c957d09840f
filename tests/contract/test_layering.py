"""The layers' one rule: the service (`app`) and the worker (`worker`) stand side by side on
`contract`, and neither reaches into the other, at the top of a module or inside a function.
The service ships the worker to Ray as a package; an import across would pull the one's
dependencies into the other's process (torch into the service, FastAPI into every rank)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each package, and the packages it may not import.
FORBIDDEN = {"app": {"worker", "bench"}, "worker": {"app", "bench"}, "contract": {"app", "worker"}}


def _imports(path: Path) -> set[str]:
    """Every top-level package a module imports, wherever in the module the import is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_across_the_layers(package: str) -> None:
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules
    crossing = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & FORBIDDEN[package])
        for path in modules
        if _imports(path) & FORBIDDEN[package]
    }
    assert crossing == {}


def test_the_rule_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n"
        "    from worker.training.trainer import build_trainer\n"
        "    import app.storage.db\n"
    )
    assert _imports(module) == {"worker", "app"}


def test_the_architecture_page_names_only_what_exists() -> None:
    """docs/architecture.md follows a run file by file; a move or a rename must take the
    page along, or this fails."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    paths = re.findall(r"`((?:app|worker|contract|tests)/[\w/]*\.py)`", page)
    assert len(paths) > 20
    assert [p for p in paths if not (ROOT / p).is_file()] == []
    # `path.py` (`name`): the function or class the step means is in that module.
    for path, name in re.findall(r"`([\w/]+\.py)` \(`(\w+)`", page):
        assert re.search(
            rf"^\s*(?:async )?(?:def|class) {name}\b", (ROOT / path).read_text(), re.M
        ), (path, name)
    # `module.function` written for a service module: that module defines it.
    for module, name in re.findall(r"`(lifecycle)\.(\w+)`", page):
        source = (ROOT / "app" / "services" / f"{module}.py").read_text()
        assert re.search(rf"^def {name}\b", source, re.M), name


def _folder(module: str) -> str:
    """The service's folder a module belongs to (`app.services.rules` its own), or the
    module itself for one at the top of `app`."""
    parts = module.split(".")
    if parts[:3] == ["app", "services", "rules"]:
        return "app.services.rules"
    return ".".join(parts[:2])


def _folder_graph(package: str = "app") -> dict[str, set[str]]:
    """Which of a package's folders imports which, wherever in a module the import is."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        source = _folder(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                if module.split(".")[0] == package and (target := _folder(module)) != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The edges a → b of `graph` from which a can be reached again."""

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for after in graph.get(todo.pop(), set()) - seen:
                if after == goal:
                    return True
                seen.add(after)
                todo.append(after)
        return False

    return sorted((a, b) for a, targets in graph.items() for b in targets if reaches(b, a))


def test_the_services_folders_import_each_other_one_way() -> None:
    """No cycle between folders (routes over services over the cluster and storage; the
    request rules under the services, the settings over the rules): a folder that imports
    one that imports it back is one tangle, whatever the folders say."""
    graph = _folder_graph()
    assert _cycles(graph) == []
    # The layers below the services stay below them.
    for low in ("app.storage", "app.cluster", "app.services.rules"):
        assert not graph.get(low, set()) & {"app.services", "app.api", "app.main"}, low


def test_the_workers_folders_import_one_way() -> None:
    """The worker's folders as docs/architecture.md draws them: the training loop over the
    model over the data, each of them free to report, and the reporting (callbacks,
    metrics, trackers, logs) reading none of them back. The entry points at the top
    (`python -m worker`, `worker.profile`, `worker.data_plan`) may use any folder."""
    graph = _folder_graph("worker")
    folders = {"worker.training", "worker.model", "worker.data", "worker.reporting"}
    assert folders <= {f"worker.{p.name}" for p in (ROOT / "worker").iterdir() if p.is_dir()}
    assert _cycles(graph) == []
    allowed = {
        "worker.training": {"worker.model", "worker.data", "worker.reporting"},
        "worker.model": {"worker.data", "worker.reporting"},
        "worker.data": {"worker.reporting"},
        "worker.reporting": set(),
    }
    assert {f: graph.get(f, set()) - allowed[f] for f in folders} == {f: set() for f in folders}


def test_the_folder_graph_sees_an_upward_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule above reads real imports: a reporting module importing the loop shows."""
    package = tmp_path / "worker"
    (package / "reporting").mkdir(parents=True)
    (package / "reporting" / "m.py").write_text(
        "def f():\n    from worker.training.loop import Attempt\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _folder_graph("worker") == {"worker.reporting": {"worker.training"}}
