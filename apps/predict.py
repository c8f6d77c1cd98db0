"""Classify raw reviews with an exported SavedModel, using TensorFlow only.

Usage:
    python -m apps.predict "A wonderful, moving film." "Dull and far too long."
    python -m apps.predict --json < reviews.txt        # one review per line
    python -m apps.predict --model path/to/saved_model "..."

This module never imports keras_sdpa or Keras: the SavedModel written by
`apps.train_sentiment` carries its own tokenizer and the XLA attention, so
anyone with TensorFlow can serve it.
"""

import argparse
import json
import os
import sys

DEFAULT_MODEL = "saved_models/imdb_sdpa"
BATCH_SIZE = 32


def resolve_model_path(path):
    """`path` itself if it is a SavedModel, else `path/saved_model` (a training run's folder)."""
    for candidate in (path, os.path.join(path, "saved_model")):
        if os.path.isfile(os.path.join(candidate, "saved_model.pb")):
            return candidate
    raise ValueError(
        f"`--model` is not a SavedModel nor a run folder holding one. Received: model={path!r}. "
        "Train one with `python -m apps.train_sentiment`."
    )


def _as_bytes(text):
    """Raw bytes of a review: str from argv (undecodable bytes kept) or bytes from stdin."""
    if isinstance(text, bytes):
        return text
    return os.fsencode(text)


def predict(serve, texts, top_k=5, max_bytes=8 << 20):
    """Returns one dict per review: label, probability, most attended tokens."""
    import tensorflow as tf

    results = []
    for start in range(0, len(texts), BATCH_SIZE):
        raw = [_as_bytes(t) for t in texts[start : start + BATCH_SIZE]]
        clipped = [r[:max_bytes] for r in raw]
        out = serve(text=tf.constant(clipped, dtype=tf.string))
        probability = out["probability"].numpy()
        lengths = out["length"].numpy()
        tokens = out["tokens"].numpy()
        pooling = out["pooling"].numpy().mean(axis=1)  # (B, L), averaged over heads
        for i, review in enumerate(raw):
            n = int(lengths[i])
            weight_by_token = {}
            for token, weight in zip(tokens[i, :n], pooling[i, :n]):
                token = token.decode("utf-8", errors="replace")
                weight_by_token[token] = weight_by_token.get(token, 0.0) + float(weight)
            top = sorted(weight_by_token.items(), key=lambda item: -item[1])[:top_k]
            result = {
                "text": review.decode("utf-8", errors="replace"),
                "label": "positive" if probability[i] >= 0.5 else "negative",
                "probability": round(float(probability[i]), 6),
                "tokens": n,
                "top_tokens": [{"token": t, "weight": round(w, 4)} for t, w in top],
            }
            if n == 0:
                result["note"] = "no known words in the review; the label is the model's prior"
            if len(review) > max_bytes:
                result["note"] = f"read the first {max_bytes} of {len(review)} bytes"
            results.append(result)
    return results


def _format(result, width=60):
    text = " ".join(result["text"].split())
    if len(text) > width:
        text = text[: width - 3] + "..."
    top = ", ".join(f"{t['token']} {t['weight']:.2f}" for t in result["top_tokens"]) or "-"
    line = f"{result['label']:8s} {result['probability']:.3f}  [{top}]  {text!r}"
    if "note" in result:
        line += f"  ({result['note']})"
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m apps.predict",
        description="Classify raw reviews with a SavedModel from apps.train_sentiment.",
    )
    parser.add_argument(
        "texts", nargs="*", help="reviews; none reads one review per line from stdin"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="SavedModel or training run folder")
    parser.add_argument("--json", action="store_true", help="one JSON object per review per line")
    parser.add_argument("--top_k", type=int, default=5, help="most attended tokens to show")
    parser.add_argument("--max_bytes", type=int, default=8 << 20, help="bytes read per review")
    args = parser.parse_args(argv)
    try:
        if args.top_k < 0:
            raise ValueError(f"`--top_k` must be >= 0. Received: top_k={args.top_k}")
        if args.max_bytes <= 0:
            raise ValueError(
                f"`--max_bytes` must be positive. Received: max_bytes={args.max_bytes}"
            )
        path = resolve_model_path(args.model)
        texts = list(args.texts)
        if not texts:
            if sys.stdin.isatty():
                raise ValueError("give reviews as arguments, or pipe one review per line to stdin")
            texts = [line.rstrip(b"\r\n") for line in sys.stdin.buffer]
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        serve = tf.saved_model.load(path).signatures["serving_default"]
        results = predict(serve, texts, top_k=args.top_k, max_bytes=args.max_bytes)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for result in results:
        print(json.dumps(result, ensure_ascii=False) if args.json else _format(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
