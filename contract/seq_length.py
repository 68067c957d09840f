"""`training.seq_length` when a request leaves it unset: chosen from the data and the model.

OpenAI's clients have no seq_length to give, and a fixed default is wrong both ways: too
long for a model with few positions (refused), far too long for short examples (padding
and memory for nothing). The worker chooses it from the tokenized training data
(worker/data/preparation.py `prepare_training`); the service's validation predicts the same
choice by running that same preparation (app/services/data_plan.py). Torch-free, shared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Lengths are rounded up to a multiple of this: kernels and memory like round shapes, and a
# few more positions cost little.
MULTIPLE = 64
# The cap for a model whose config names no maximum positions.
UNKNOWN_MAX_POSITIONS = 2048


def max_positions_of(config: Mapping[str, Any]) -> int | None:
    """The longest sequence a model's config.json says it takes, where it says."""
    value = (
        config.get("max_position_embeddings") or config.get("n_positions") or config.get("n_ctx")
    )
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def seq_length_cap(config: Mapping[str, Any] | None) -> int:
    """The longest seq_length an unset one may become: the model's maximum positions."""
    known = max_positions_of(config) if config is not None else None
    return known or UNKNOWN_MAX_POSITIONS


def chosen_seq_length(longest: int, cap: int) -> int:
    """The longest tokenized example rounded up to a multiple of MULTIPLE, at most `cap`."""
    return max(2, min(cap, math.ceil(max(longest, 1) / MULTIPLE) * MULTIPLE))


def choice_note(
    *, chosen: int, longest: int, cap: int, truncated: int, examples: int, room: int = 0
) -> str:
    """What an event says of the choice, and what it cost; `room`: the positions left to
    the completions (`completion_room`), which `cap` already leaves out."""
    longest_words = f"more than {cap}" if longest > cap else str(longest)
    limit = f" less method.max_completion_tokens ({room})" if room else ""
    cut = (
        f"; {truncated} of {examples} examples are longer and were truncated to it"
        if truncated
        else "; no example is truncated"
    )
    return (
        f"training.seq_length was not set: chose {chosen} from the data (the longest "
        f"tokenized example has {longest_words} tokens, rounded up to a multiple of "
        f"{MULTIPLE}, at most the model's maximum positions{limit}, {cap}){cut}"
    )


def completion_room(definition: Any) -> int:
    """Positions a row needs past its seq_length tokens: method grpo's prompts (seq_length
    long at most) are followed by completions of up to max_completion_tokens."""
    method = definition.method
    return int(method.max_completion_tokens) if method.type == "grpo" else 0
