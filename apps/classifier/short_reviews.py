"""Short reviews cut from long ones: how the classifier reads a sentence, a few, a paragraph.

People type a sentence; IMDB's reviews run to hundreds of words. `spans` cuts, from each of
a sample of labelled reviews, one span per length bucket (`BUCKETS`): a single sentence, two or
three consecutive sentences, a paragraph's worth (four to eight), and the whole review. Each
span keeps its review's label. The spans are drawn with a fixed seed, from the test split only.
"""

import re

import numpy as np

# (name, fewest sentences, most sentences); None: the whole review.
BUCKETS = (
    ("1 sentence", 1, 1),
    ("2-3 sentences", 2, 3),
    ("a paragraph (4-8 sentences)", 4, 8),
    ("the whole review", None, None),
)
MIN_WORDS = 2  # a one-word "sentence" (a stray "Yes." or "10/10") is not one
_BREAK = re.compile(rb"<br\s*/?>", re.IGNORECASE)
_SENTENCE_END = re.compile(rb"(?<=[.!?])[\"')\]]*\s+")


def sentences(text):
    """The sentences of a review (bytes): split after `.`, `!` or `?` and at line breaks,
    each of at least `MIN_WORDS` words, whitespace collapsed."""
    out = []
    for piece in _BREAK.split(text):
        for sentence in _SENTENCE_END.split(piece):
            words = sentence.split()
            if len(words) >= MIN_WORDS:
                out.append(b" ".join(words))
    return out


def _draw_span(parts, fewest, most, rng):
    """`fewest` to `most` consecutive sentences of `parts` (at least `fewest` long), of a
    random size, from a random start."""
    size = int(rng.integers(fewest, min(most, len(parts)) + 1))
    start = int(rng.integers(0, len(parts) - size + 1))
    return b" ".join(parts[start : start + size])


def training_spans(texts, labels, fraction, seed, most=3):
    """`(texts, labels)`: for a `fraction` of the reviews, drawn with `seed`, one span of 1 to
    `most` consecutive sentences starting at a random one, with its review's label. Training
    on them as well as on the whole reviews shows the model short texts like the ones people
    type."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"`fraction` must be in [0, 1]. Received: fraction={fraction}")
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.permutation(len(texts))[: int(round(fraction * len(texts)))])
    out_texts, out_labels = [], []
    for index in chosen:
        parts = sentences(texts[index])
        if not parts:
            continue
        out_texts.append(_draw_span(parts, 1, most, rng))
        out_labels.append(int(labels[index]))
    return np.array(out_texts, dtype=object), np.array(out_labels, np.int64)


def spans(texts, labels, count, seed):
    """`{bucket name: (texts, labels)}`: for up to `count` reviews drawn with `seed`, one span
    per bucket, consecutive sentences starting at a random one. A review too short for a
    bucket gives that bucket nothing, so each bucket holds what it names."""
    if count < 1:
        raise ValueError(f"`count` must be >= 1. Received: count={count}")
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(len(texts))[:count]
    out = {name: ([], []) for name, _, _ in BUCKETS}
    for index in chosen:
        parts = sentences(texts[index])
        for name, fewest, most in BUCKETS:
            if fewest is None:
                span = texts[index]
            else:
                if len(parts) < fewest:
                    continue
                span = _draw_span(parts, fewest, most, rng)
            out[name][0].append(span)
            out[name][1].append(int(labels[index]))
    return {
        name: (np.array(spans_, dtype=object), np.array(labels_, np.int64))
        for name, (spans_, labels_) in out.items()
    }
