"""The bounds of `POST /v1/runs/validate`'s data plan (an unset seq_length chosen from the
data, packed rows counted by `python -m worker.data_plan` on the service's host): counts
hold no shared thread and no key holds every slot, a request's template gets a memory
bound, nothing is left on disk, data the worker refuses is refused, and the cache answers
only for the same tokenizer. None starts Ray or trains."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.services import data_plan
from app.settings import Settings
from contract.run_request import RunSpec
from tests.app.conftest import served
from tests.conftest import make_api_key
from worker.data.preparation import prepare_training
from worker.model.loading import load_tokenizer

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: nothing here depends on the database, and some tests are slow."""
    return sqlite_url


def _text_file(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def _chat_file(path: Path, rows: int = 12) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"the market rose on day {i}"},
                        {"role": "assistant", "content": "rain fell on the old town"},
                    ]
                }
            )
            + "\n"
            for i in range(rows)
        )
    )
    return path


def _validate_quietly(url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """A validate the test holds up, whatever becomes of it."""
    with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=url, timeout=150) as http:
        http.post("/v1/runs/validate", json=body, headers=headers)


NEWS = [f"the market rose as rain fell on the old town on day {i}" for i in range(40)]


# -- 1. validate's counting must not take the service's shared worker threads ----------------


def test_slow_data_plans_leave_uploads_and_other_threaded_routes_answering(
    settings: Settings,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counts wait for one of 2 slots on a thread of AnyIO's default limiter (40 threads),
    the limiter that uploads, GET /v1/files/{id}, GET /v1/fine_tuning/jobs and the event
    streams also use: 40 validates whose counts are slow (a chat template that loops until
    the 300 s timeout, say) leave every one of those routes hanging, for every API key."""
    release = threading.Event()
    real_run = subprocess.run

    def held(args: Any, **kwargs: Any) -> Any:
        if "worker.data_plan" not in args:
            return real_run(args, **kwargs)
        release.wait(120)
        return subprocess.CompletedProcess(args, 0, stdout='{"error": "held"}\n', stderr="")

    monkeypatch.setattr(data_plan.subprocess, "run", held)
    hostile = {"Authorization": f"Bearer {make_api_key(session_factory, 'hostile')}"}
    victim = {"Authorization": f"Bearer {make_api_key(session_factory, 'victim')}"}
    data = _text_file(tmp_path / "news.jsonl", NEWS)

    with served(create_app(settings, start_background=False)) as url:

        def validate(i: int) -> None:
            body = {
                "model": str(tiny_model_dir),
                "dataset": {"source": str(data)},
                "training": {"packing": True, "seq_length": 2 + i},
            }
            _validate_quietly(url, body, hostile)

        floods = [threading.Thread(target=validate, args=(i,), daemon=True) for i in range(44)]
        try:
            for thread in floods:
                thread.start()
            time.sleep(5)  # every validate has reached its count
            with httpx.Client(base_url=url, timeout=15) as http:
                try:
                    upload = http.post(
                        "/v1/files",
                        files={"file": ("t.jsonl", b'{"text": "hello there world"}\n')},
                        data={"purpose": "text"},
                        headers=victim,
                    )
                    jobs = http.get("/v1/fine_tuning/jobs", headers=victim)
                except httpx.TimeoutException:
                    pytest.fail("another key's upload hung while validates waited to count")
                assert upload.status_code == 201, upload.text
                assert jobs.status_code == 200, jobs.text
        finally:
            release.set()
            for thread in floods:
                thread.join(timeout=60)


# -- 2. one API key cannot hold every counting slot -------------------------------------------


def test_one_keys_slow_counts_do_not_hold_up_another_keys_validate(
    settings: Settings,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 2 counting slots are shared by every key, first come first served, and a count
    may take 300 s: one key with two slow validates (e.g. a chat template of nested
    `range(100000)` loops) makes every other key's validate wait minutes."""
    release = threading.Event()
    real_run = subprocess.run

    def slow_for_hold(args: Any, **kwargs: Any) -> Any:
        if "worker.data_plan" in args and "HOLD" in kwargs.get("input", ""):
            release.wait(120)
            return subprocess.CompletedProcess(args, 0, stdout='{"error": "held"}\n', stderr="")
        return real_run(args, **kwargs)

    monkeypatch.setattr(data_plan.subprocess, "run", slow_for_hold)
    hostile = {"Authorization": f"Bearer {make_api_key(session_factory, 'hostile')}"}
    victim = {"Authorization": f"Bearer {make_api_key(session_factory, 'victim')}"}
    chat = _chat_file(tmp_path / "chat.jsonl")
    news = _text_file(tmp_path / "news.jsonl", NEWS)

    with served(create_app(settings, start_background=False)) as url:

        def hold(i: int) -> None:
            body = {
                "model": str(tiny_model_dir),
                "dataset": {
                    "source": str(chat),
                    "format": "chat",
                    "chat_template": CHATML + f"{{# HOLD {i} #}}",
                },
            }
            _validate_quietly(url, body, hostile)

        holders = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(2)]
        try:
            for thread in holders:
                thread.start()
            time.sleep(3)
            with httpx.Client(base_url=url, timeout=60) as http:
                body = {"model": str(tiny_model_dir), "dataset": {"source": str(news)}}
                try:
                    report = http.post("/v1/runs/validate", json=body, headers=victim).json()
                except httpx.TimeoutException:
                    pytest.fail("another key's two counts held this key's validate for 60 s")
            assert report["valid"], report
            assert report["resolved"]["seq_length"] == 64, report["resolved"]
        finally:
            release.set()
            for thread in holders:
                thread.join(timeout=60)


# -- 3. a request's chat template cannot take gigabytes of the service host's memory ---------


def test_a_chat_template_cannot_make_a_validate_allocate_gigabytes_on_the_service(
    client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The count runs the request's Jinja template on the service's host, bounded by a
    300 s wall clock only: a 90-byte template builds a 600-million-character string per
    conversation (about 2.6 GB peak RSS here; 1.5e9 took 6 GB), and two run at once. The
    count should run under a memory bound and say it could not count, not succeed.

    (Unfixed, this test itself takes ~2.6 GB for ~15 s.)"""
    chat = _chat_file(tmp_path / "chat.jsonl", rows=4)
    template = "{% set s = 'a' * 600000000 %}" + CHATML
    body = {
        "model": str(tiny_model_dir),
        "dataset": {"source": str(chat), "format": "chat", "chat_template": template},
    }
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    counted = report["valid"] and report["resolved"]["seq_length"] is not None
    assert not counted, "the template's 600 MB string was built on the service host"


# -- 4. the worker's data preparation leaves no dataset cache on the service host ------------


def test_validate_leaves_no_datasets_cache_on_the_service_host(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each count writes the dataset as Arrow (json-train.arrow) plus one cache file per
    map/filter into the service user's ~/.cache/huggingface/datasets, and nothing removes
    them: an 11 MB file left 55 MB per validate, more with each new seq_length or
    max_samples, so a key can fill the service's disk by validating."""
    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    # Bytes of this test's own: the service's in-process cache answers no earlier count.
    data = _text_file(tmp_path / "news.jsonl", [*NEWS, f"the market {uuid.uuid4().hex}"])
    body = {"model": str(tiny_model_dir), "dataset": {"source": str(data)}}
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert report["valid"] and report["resolved"]["seq_length"] == 64, report
    left = (
        sorted(str(p.relative_to(cache)) for p in cache.rglob("*.arrow")) if cache.exists() else []
    )
    assert left == [], f"validate left {len(left)} Arrow files in the service's cache: {left[:3]}"


# -- 5. data the worker's own preparation refuses is not a valid request -----------------------


def test_a_request_whose_data_preparation_fails_is_not_reported_valid(
    client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A new user's defaults with packing on a small file: the worker chooses seq_length 64
    and `pack_sequences` raises "the dataset holds fewer than seq_length (64) tokens to
    pack", on the service exactly as it will on the cluster. validate answered valid: true
    (the failure tucked into resolved.data_unknown_because) and the run is accepted, to fail
    after it is placed. The same for a chat template that raises on every record."""
    data = _text_file(tmp_path / "three.jsonl", ["The Lions beat the Tigers.", "Rain in Oslo."])
    body = {
        "model": str(tiny_model_dir),
        "dataset": {"source": str(data)},
        "training": {"packing": True},
        "resources": {"num_workers": 1},
    }
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    assert report["valid"] is False, report.get("resolved")
    fields = {e["field"] for e in report["errors"]}
    assert fields & {"training.packing", "training.seq_length", "dataset.source"}, report


# -- 6. the count's cache key covers every tokenizer file the worker reads --------------------


def test_a_model_with_another_chat_template_is_not_answered_from_the_cache(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    tiny_model_dir: Path,
    session_factory: sessionmaker[Session],
) -> None:
    """transformers 5 reads a tokenizer's chat template from
    `additional_chat_templates/default.jinja` (app/services/rules/model_files.py says so too), but
    the cache key hashes only a fixed list of files (`_TOKENIZER_FILES`; neither that folder
    nor tokenizer.model, vocab.txt or added_tokens.json). Two folders that differ there
    share an entry: whichever key validates first fixes the other's seq_length and steps,
    across API keys too."""
    chat = _chat_file(tmp_path / "chat.jsonl")
    short = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    long = "{% for m in messages %}" + "system notice: " * 6 + "{{ m.content }}\n{% endfor %}"
    folders = {}
    for name, template in (("short", short), ("long", long)):
        folder = tmp_path / f"model-{name}"
        shutil.copytree(tiny_model_dir, folder)
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "default.jinja").write_text(template)
        folders[name] = folder

    def chosen(folder: Path, headers: dict[str, str]) -> int | None:
        body = {"model": str(folder), "dataset": {"source": str(chat), "format": "chat"}}
        report = client.post("/v1/runs/validate", json=body, headers=headers).json()
        assert report["valid"], report
        return report["resolved"]["seq_length"]

    other = {"Authorization": f"Bearer {make_api_key(session_factory, 'other')}"}
    assert chosen(folders["short"], other) == 64
    spec = RunSpec.for_attempt(
        {
            "model": str(folders["long"]),
            "dataset": {"source": str(chat), "format": "chat"},
        },
        run_id="run_x",
        attempt=1,
        storage_path="/unused",
    )
    workers = prepare_training(spec, load_tokenizer(spec), notes=[])[0].training.seq_length
    assert workers == 128  # the long template's conversations are over 64 tokens
    assert chosen(folders["long"], auth) == workers
