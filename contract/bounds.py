"""Limits every stored value obeys, shared by the request contract and the service's own
parameters and callback bodies: a value past them is refused with a 422 that names it
rather than sent to the database to fail there (a 500)."""

from __future__ import annotations

# The largest values PostgreSQL's INTEGER and BIGINT columns hold.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def refuse_nul(value: str | None) -> str | None:
    """For strings that are stored or reach a query: PostgreSQL text cannot hold NUL
    (pydantic itself refuses lone surrogates, the other text it cannot hold)."""
    if value is not None and "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value
