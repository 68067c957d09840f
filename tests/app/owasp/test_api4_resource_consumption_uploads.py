"""API4 Unrestricted Resource Consumption: uploads (POST /v1/files).

An upload is bounded while it arrives: a body past TUNEYARD_MAX_UPLOAD_BYTES is refused at
its declared length or at the first chunk past the limit, its rest never read (before, the
whole body was read and spooled to disk, and only then refused). Receiving and checking a
file holds no database lock, so a large upload does not stall SQLite's other writers.
Records that would exhaust the checker (JSON nested to blow the stack, a line of a gigabyte)
are a 422 naming the line, not a 500 or a gigabyte held in memory.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.services import files as files_service
from app.services.rules import file_checks
from app.settings import Settings
from tests.app.conftest import HTTP_TIMEOUT_S
from tests.conftest import make_api_key
from tests.factories import run_request

BOUNDARY = "tuneyard-test-boundary"
MULTIPART = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
CHUNK = 16 * 1024


def _head(filename: str = "big.jsonl") -> bytes:
    return (
        f"--{BOUNDARY}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


def _tail() -> bytes:
    return f"\r\n--{BOUNDARY}--\r\n".encode()


class _Body:
    """A multipart upload of `total` bytes of JSONL, produced chunk by chunk as the server
    asks for it; `chunks_read` counts how many it asked for."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.chunks_read = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        line = (json.dumps({"text": "x" * (CHUNK - 20)}) + "\n").encode()
        self.chunks_read += 1
        yield _head()
        sent = 0
        while sent < self.total:
            self.chunks_read += 1
            yield line
            sent += len(line)
        self.chunks_read += 1
        yield _tail()


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _post_streamed(
    app: FastAPI, body: AsyncIterable[bytes], headers: dict[str, str]
) -> httpx.Response:
    """POST /v1/files straight to the app. Not through TestClient, which reads a streamed
    body whole before the app asks for its first chunk."""

    async def post() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://tuneyard") as http:
                return await http.post("/v1/files", content=body, headers=headers)

    return anyio.run(post)


def _stored(settings: Settings) -> list[Path]:
    folder = settings.uploads_dir
    return sorted(folder.iterdir()) if folder.exists() else []


@pytest.fixture
def small_limit(
    settings: Settings, session_factory: sessionmaker[Session]
) -> tuple[FastAPI, dict[str, str], Settings]:
    """An app whose uploads may be at most 1000 bytes."""
    small = settings.model_copy(update={"max_upload_bytes": 1000})
    auth = {"Authorization": f"Bearer {make_api_key(session_factory)}", **MULTIPART}
    return create_app(small, start_background=False), auth, small


class TestUploadSizeLimit:
    def test_a_chunked_body_past_the_limit_is_refused_without_reading_the_rest(
        self, small_limit: tuple[FastAPI, dict[str, str], Settings]
    ) -> None:
        app, headers, small = small_limit
        body = _Body(total=8 << 20)
        # A generator body goes out chunked, with no Content-Length to refuse it by.
        response = _post_streamed(app, body, headers)

        assert response.status_code == 413, response.text
        assert response.json()["error"] == "payload_too_large"
        assert "1000-byte limit" in response.json()["detail"]
        # The limit plus the multipart allowance is 65 KiB: about five chunks of 16 KiB, of
        # the 515 the whole body has.
        assert body.chunks_read <= (1000 + 64 * 1024) // CHUNK + 2
        assert _stored(small) == []

    def test_a_declared_length_past_the_limit_is_refused_before_any_byte_is_read(
        self, small_limit: tuple[FastAPI, dict[str, str], Settings]
    ) -> None:
        app, headers, _ = small_limit
        body = _Body(total=8 << 20)
        response = _post_streamed(app, body, {**headers, "content-length": str(8 << 20)})

        assert response.status_code == 413, response.text
        assert "1000-byte limit" in response.json()["detail"]
        assert body.chunks_read == 0

    def test_a_file_at_the_limit_still_fits_with_its_framing(
        self, small_limit: tuple[FastAPI, dict[str, str], Settings]
    ) -> None:
        app, headers, small = small_limit
        line = (json.dumps({"text": "y" * 80}) + "\n").encode()
        data = line * (1000 // len(line))
        response = _post_streamed(app, _chunks(_head("fits.jsonl"), data, _tail()), headers)

        assert response.status_code == 201, response.text
        assert response.json()["bytes"] == len(data)
        assert [p.read_bytes() for p in _stored(small)] == [data]


class TestUploadHoldsNoWriteLock:
    def test_another_write_completes_while_an_upload_is_being_checked(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        checking, release = threading.Event(), threading.Event()
        real_check = files_service.check_file

        def slow_check(*args: Any, **kwargs: Any) -> file_checks.FileReport:
            # Stands for a large file whose every record takes a while to check.
            checking.set()
            release.wait(timeout=2 * HTTP_TIMEOUT_S)
            return real_check(*args, **kwargs)

        monkeypatch.setattr(files_service, "check_file", slow_check)
        data = b'{"text": "a b"}\n' * 4
        with ThreadPoolExecutor(max_workers=2) as pool:
            upload = pool.submit(
                client.post, "/v1/files", files={"file": ("d.jsonl", data)}, headers=auth
            )
            try:
                deadline = time.monotonic() + HTTP_TIMEOUT_S
                while not checking.wait(timeout=0.1):
                    # An upload refused before its check says why; a slow one gets time.
                    assert not upload.done(), upload.result().text
                    assert time.monotonic() < deadline, "the upload never reached its check"
                create = pool.submit(
                    client.post, "/v1/runs", json=run_request(tmp_path), headers=auth
                )
                # On SQLite the upload used to hold the one writer's lock through its check:
                # the run waited for it.
                created = create.result(timeout=HTTP_TIMEOUT_S)
                assert created.status_code == 201, created.text
                assert not upload.done()
            finally:
                release.set()
            uploaded = upload.result(timeout=HTTP_TIMEOUT_S)
        assert uploaded.status_code == 201, uploaded.text


def _upload(client: TestClient, auth: dict[str, str], data: bytes, name: str) -> Any:
    return client.post("/v1/files", files={"file": (name, data)}, headers=auth)


def _problems(response: Any) -> list[str]:
    assert response.status_code == 422, response.text
    return [problem["message"] for problem in response.json()["detail"]]


class TestRecordsThatWouldExhaustTheChecker:
    def test_json_nested_past_the_decoders_depth_is_a_422_naming_the_line(
        self, client: TestClient, auth: dict[str, str], settings: Settings
    ) -> None:
        deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
        data = f'{{"text": "fine"}}\n{deep}\n{{"text": ""}}\n'.encode()

        response = _upload(client, auth, data, "deep.jsonl")

        assert _problems(response) == [
            "line 2: JSON nested too deeply",
            "line 3: field 'text' is empty",
        ]
        assert _stored(settings) == []

    def test_a_jsonl_line_past_the_limit_is_a_422_naming_the_line(
        self, client: TestClient, auth: dict[str, str], settings: Settings
    ) -> None:
        long = json.dumps({"text": "x" * file_checks.MAX_LINE_BYTES})
        data = f'{{"text": "fine"}}\n{long}\n{{"body": "no text"}}\n'.encode()

        response = _upload(client, auth, data, "long.jsonl")

        assert _problems(response) == [
            f"line 2: longer than the {file_checks.MAX_LINE_BYTES}-byte limit for one record",
            "line 3: missing field 'text'",
        ]
        assert _stored(settings) == []

    def test_a_csv_line_past_the_limit_is_a_422_naming_the_line(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        data = b"text\nfine\n" + b"x" * (file_checks.MAX_LINE_BYTES + 1) + b"\nmore\n"

        response = _upload(client, auth, data, "long.csv")

        assert _problems(response) == [
            f"line 3: longer than the {file_checks.MAX_LINE_BYTES}-byte limit for one record"
        ]
