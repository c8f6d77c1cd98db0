"""The lengths the SavedModel computes reviews at, and a review's token count without TensorFlow.

Kept free of Keras and TensorFlow: `apps.serving.export` builds `serving_default` from these
buckets, and `apps.predict` (which never imports Keras) groups its batches by them.
"""

import bisect
import re

# Positions a review is computed at: the first that holds it. Steps of 1.5x and 1.33x: powers
# of two alone pad a review to 1.4x its length on average, and attention grows as its square.
LENGTH_BUCKETS = (64, 96, 128, 192, 256, 384, 512)

_LINE_BREAK = re.compile(rb"<br\s*/?>", re.IGNORECASE)
# A word as `apps.classifier.data.standardize` leaves it: letters and digits, with apostrophes
# inside or at its ends (stripped there, which does not change the count); a run of
# apostrophes alone is no word. `[^\W_]` is a letter or a digit.
_WORD = re.compile(r"'*[^\W_]+(?:'+[^\W_]*)*")


def bucket_sizes(sequence_length, buckets=LENGTH_BUCKETS):
    """The lengths the SavedModel computes reviews at: `buckets` below `sequence_length`,
    then `sequence_length` itself."""
    return tuple(b for b in buckets if b < sequence_length) + (sequence_length,)


def count_tokens(text):
    """The number of words the app's vectorizer reads in `text` (bytes), before it cuts the
    review to the sequence length; known words and unknown ones alike."""
    return len(_WORD.findall(_LINE_BREAK.sub(b" ", text).decode("utf-8", errors="replace")))


def bucket_of(tokens, buckets=LENGTH_BUCKETS):
    """Index of the first bucket that holds `tokens`; the last one for longer reviews."""
    return min(bisect.bisect_left(buckets, tokens), len(buckets) - 1)
