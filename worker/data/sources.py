"""Where a run's model and dataset come from, as the worker loads them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from contract.datasets import is_local_source


def refuse_shadowed_hub_id(setting: str, source: str) -> None:
    """A hub id must load from the hub. transformers and datasets try a relative folder of
    the same name first, so one in the job's working directory would be loaded instead,
    outside the allowed roots the service checked."""
    if is_local_source(source) or not os.path.lexists(source):
        return
    raise ValueError(
        f"{setting} {source!r} is a hub id, but {source!r} also exists in the job's working "
        f"directory ({os.getcwd()}), which would be loaded in its place; give the model or "
        "dataset as an absolute path instead"
    )


@contextmanager
def loading_errors(model: str) -> Iterator[None]:
    """transformers' loading errors end in generic advice; lead with what could not load."""
    refuse_shadowed_hub_id("model", model)
    try:
        yield
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load model {model!r}: {first}") from exc
