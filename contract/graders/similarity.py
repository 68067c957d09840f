"""`text_similarity`'s metrics, each a score in [0, 1], computed by the library OpenAI's
guide names for it: rapidfuzz (fuzzy_match), sacrebleu (bleu), NLTK (gleu, meteor) and
Google's rouge-score (rouge_1 to rouge_5, rouge_l: the F-measure). `cosine` compares
embeddings from OpenAI's text-embedding-3-large, which this service does not have, and
`meteor` needs NLTK's WordNet data, which no hub download may fetch here: each is refused
with that reason where the grader is checked (see `unavailable`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

ROUGE = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}
# ROUGE-L's longest common subsequence is a table of word pairs, in pure Python: past this
# (two texts of 2,000 words each) a grade would hold a CPU for seconds to minutes.
MAX_LCS_CELLS = 4_000_000


class TextTooLong(ValueError):
    """The texts are too long for the metric to score in reasonable time."""


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
        words = len(candidate.split()) * len(reference.split())
        if kind == "rougeL" and words > MAX_LCS_CELLS:
            raise TextTooLong(
                f"rouge_l compares every word of one text with every word of the other: "
                f"{words} pairs here, past {MAX_LCS_CELLS}"
            )
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
    perfect match comes out a rounding error above 1)."""
    return min(1.0, max(0.0, _SCORERS[metric](candidate, reference)))
