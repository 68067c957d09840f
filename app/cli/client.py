"""A small synchronous client for tuneyard's REST API, used by the CLI and the demo."""

from __future__ import annotations

import io
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx


class ApiError(Exception):
    """The service answered with an error; `detail` is its body's `detail`."""

    def __init__(self, status_code: int, error: str, detail: Any) -> None:
        super().__init__(f"{status_code} {error}: {detail}")
        self.status_code = status_code
        self.error = error
        self.detail = detail


class Unreachable(Exception):
    """No answer from the service at all."""


class TuneyardClient:
    def __init__(self, base_url: str, api_key: str | None, *, timeout: float = 30) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def __enter__(self) -> TuneyardClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()

    def _raise_for(self, response: httpx.Response) -> None:
        if response.is_error:
            try:
                body = response.json()
            except ValueError:
                body = {"error": "http_error", "detail": response.text}
            raise ApiError(response.status_code, body.get("error", "error"), body.get("detail"))

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise Unreachable(f"cannot reach tuneyard at {self.base_url}: {exc}") from exc
        self._raise_for(response)
        return response

    def create_run(
        self, spec: dict[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._call("POST", "/v1/runs", json=spec, headers=headers).json()
        return result

    def validate(
        self, spec: dict[str, Any], *, profile: bool = False, profile_steps: int | None = None
    ) -> dict[str, Any]:
        """With `profile`, the service also trains a few steps on the cluster before it
        answers: minutes for a large model, so no read timeout then (the service has its
        own, TUNEYARD_PROFILE_TIMEOUT_S)."""
        body, timeout = spec, self.http.timeout
        if profile:
            body = {**spec, "profile": True}
            if profile_steps is not None:
                body["profile_steps"] = profile_steps
            timeout = httpx.Timeout(self.http.timeout.connect, read=None)
        result: dict[str, Any] = self._call(
            "POST", "/v1/runs/validate", json=body, timeout=timeout
        ).json()
        return result

    def list_runs(
        self, *, status: str | None, metadata: dict[str, str], limit: int
    ) -> list[dict[str, Any]]:
        params: dict[str, Any] = {f"metadata.{k}": v for k, v in metadata.items()}
        if status:
            params["status"] = status
        runs: list[dict[str, Any]] = []
        cursor = None
        while len(runs) < limit:
            params.update(limit=min(limit - len(runs), 100), cursor=cursor)
            page = self._call(
                "GET", "/v1/runs", params={k: v for k, v in params.items() if v is not None}
            ).json()
            runs += page["data"]
            cursor = page["next_cursor"]
            if not cursor:
                break
        return runs

    def get_run(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/runs/{run_id}").json()
        return result

    def cancel(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/runs/{run_id}/cancel").json()
        return result

    def resume(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/runs/{run_id}/resume").json()
        return result

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self._call("GET", f"/v1/runs/{run_id}/checkpoints").json()[
            "data"
        ]
        return data

    def logs(self, run_id: str, *, tail: int | None = None) -> str:
        params = {"tail": tail} if tail else {}
        return self._call("GET", f"/v1/runs/{run_id}/logs", params=params).text

    def events(self, run_id: str, *, after: int | None = None) -> Iterator[dict[str, Any]]:
        params = {"after": after} if after is not None else {}
        yield from self._call("GET", f"/v1/runs/{run_id}/events", params=params).json()["data"]

    def download_model(self, run_id: str, dest: Path) -> Path:
        """The run's exported model unpacked into `dest`, which must not exist yet. It is
        unpacked beside it first and renamed when complete: a folder at `dest` is whole."""
        if dest.exists():
            raise FileExistsError(f"{dest} already exists: name a new folder")
        partial = dest.with_name(f".{dest.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            with self.http.stream("GET", f"/v1/runs/{run_id}/model", timeout=None) as response:
                if response.is_error:
                    response.read()
                    self._raise_for(response)
                reader = io.BufferedReader(_ChunkReader(response.iter_raw()), 1 << 20)
                with tarfile.open(fileobj=reader, mode="r|") as archive:
                    # "data": no absolute paths, links or devices, nothing outside `partial`.
                    archive.extractall(partial, filter="data")
        except httpx.TransportError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise Unreachable(f"the download from {self.base_url} broke off: {exc}") from exc
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        partial.rename(dest)
        return dest


class _ChunkReader(io.RawIOBase):
    """A response's byte chunks as a readable stream, for tarfile's streaming mode."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            self._pending = next(self._chunks, b"")
            if not self._pending:
                return 0
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size
