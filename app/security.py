"""Secrets: API keys for clients and per-run tokens for workers. Only hashes are stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_secret(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_secret(secret: str) -> str:
    # The secrets are 256-bit random, so a fast unsalted hash is enough: nothing to brute-force.
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, expected_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), expected_hash)
