"""`text_similarity`'s metrics, each a score in [0, 1], computed by the library OpenAI's
guide names for it: rapidfuzz (fuzzy_match), sacrebleu (bleu), NLTK (gleu, meteor) and
Google's rouge-score (rouge_1 to rouge_5, rouge_l: the F-measure). `cosine` compares
embeddings from OpenAI's text-embedding-3-large, which this service does not have, and
`meteor` needs NLTK's WordNet data, which no hub download may fetch here: each is refused
with that reason where the grader is checked (see `unavailable`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

ROUGE = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}
# Past these bounds a grade would hold a CPU for seconds to hours (measured on this
# project's 2-core machine), and rapidfuzz holds the GIL while it works: on /graders/run,
# which grades in the service's own process, every other request would wait. Texts past
# them are OpenAI's truncated_observation_error.
# - Tokens per text, counted as no metric's tokenizer can exceed (each run of word
#   characters and each other non-space character): BLEU, GLEU and ROUGE-n are about
#   linear in them (ROUGE stems every word in Python: ~0.15 s at 4,000 words).
MAX_TOKENS = 10_000
# - ROUGE-L's longest common subsequence is a table of token pairs, in pure Python
#   (~0.5 s at 1,000 x 1,000).
MAX_LCS_CELLS = 1_000_000
# - fuzzy_match (rapidfuzz's WRatio) aligns the shorter text along the longer when their
#   lengths differ: characters x characters (~12 s at 20,000 x 2,000).
MAX_ALIGNMENT_CELLS = 4_000_000
_TOKEN = re.compile(r"\w+|[^\w\s]")


class TextTooLong(ValueError):
    """The texts are too long for the metric to score in reasonable time."""


def _tokens(text: str) -> int:
    if len(text) > 20 * MAX_TOKENS:  # surely past the bound, without listing its tokens
        return len(text)
    return sum(1 for _ in _TOKEN.finditer(text))


def _check_size(metric: str, candidate: str, reference: str) -> None:
    if metric == "fuzzy_match":
        cells = len(candidate) * len(reference)
        if cells > MAX_ALIGNMENT_CELLS:
            raise TextTooLong(
                f"fuzzy_match aligns every character of one text with the other's: "
                f"{len(candidate)} x {len(reference)} characters here, past "
                f"{MAX_ALIGNMENT_CELLS:,} pairs"
            )
        return
    counts = _tokens(candidate), _tokens(reference)
    if max(counts) > MAX_TOKENS:
        raise TextTooLong(f"{metric} scores texts of at most {MAX_TOKENS:,} tokens each")
    if metric == "rouge_l" and counts[0] * counts[1] > MAX_LCS_CELLS:
        raise TextTooLong(
            f"rouge_l compares every token of one text with every token of the other: "
            f"{counts[0]} x {counts[1]} here, past {MAX_LCS_CELLS:,} pairs"
        )


METRICS = ("cosine", "fuzzy_match", "bleu", "gleu", "meteor", *ROUGE)


def _fuzzy_match(candidate: str, reference: str) -> float:
    from rapidfuzz import fuzz

    return float(fuzz.WRatio(candidate, reference)) / 100.0


def _bleu(candidate: str, reference: str) -> float:
    import sacrebleu

    return float(sacrebleu.sentence_bleu(candidate, [reference]).score) / 100.0


def _gleu(candidate: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([reference.split()], candidate.split()))


def _meteor(candidate: str, reference: str) -> float:
    from nltk.translate.meteor_score import single_meteor_score

    return float(single_meteor_score(reference.split(), candidate.split()))


@cache
def _rouge_scorer(kind: str) -> object:
    from rouge_score import rouge_scorer

    # One kind per scorer: rouge-score computes every kind it was given on each call, and
    # ROUGE-L's table is quadratic in the texts' lengths.
    return rouge_scorer.RougeScorer([kind], use_stemmer=True)


def _rouge(kind: str) -> Callable[[str, str], float]:
    def score(candidate: str, reference: str) -> float:
        scores = _rouge_scorer(kind).score(reference, candidate)  # type: ignore[attr-defined]
        return float(scores[kind].fmeasure)

    return score


_SCORERS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy_match,
    "bleu": _bleu,
    "gleu": _gleu,
    "meteor": _meteor,
    **{metric: _rouge(kind) for metric, kind in ROUGE.items()},
}


@cache
def _has_wordnet() -> bool:
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
    except (LookupError, OSError):
        return False
    return True


def unavailable(metric: str) -> str | None:
    """Why this service cannot compute `metric`, or None when it can."""
    if metric == "cosine":
        return (
            "cosine compares embeddings from OpenAI's text-embedding-3-large, which a "
            "self-hosted service does not have (OpenAI offers it for evals only); use "
            "fuzzy_match, bleu, gleu or a rouge metric"
        )
    if metric == "meteor" and not _has_wordnet():
        return (
            "meteor needs NLTK's WordNet data, which is not installed where this service "
            "runs (an operator can install it: python -m nltk.downloader wordnet)"
        )
    return None


def score(metric: str, candidate: str, reference: str) -> float:
    """`candidate`'s similarity to `reference` by `metric`, in [0, 1] (clipped: BLEU of a
    perfect match comes out a rounding error above 1). Raises TextTooLong past the bounds
    above."""
    _check_size(metric, candidate, reference)
    return min(1.0, max(0.0, _SCORERS[metric](candidate, reference)))
