"""The exported SavedModel as a service runs it: reviews/s, latency, and `apps.predict` at volume.

The SavedModel is loaded with plain TensorFlow in a process that never imports `keras_sdpa`
(checked at the end), and fed IMDB test reviews in the split's own order. For each
signature it reports:

- reviews/s at batch 256, 32 and 1, in rounds that alternate `serving_default` (label and
  probability, each review at its length bucket) and `inspect` (tokens and every attention
  weight, every review at 512 positions: what `serving_default` returned before), with the
  median of the per-round ratios and their range;
- p50 and p99 latency of one review a call: in blocks of `--latency_block` calls of one
  signature (a service that serves it), the blocks alternating between the two; and with the
  two signatures interleaved call by call, where each call finds the caches the other one
  left (a service that mixes them);
- the end-to-end rate of `python -m apps.predict --input FILE --json` on the whole test split
  (25,000 reviews), start-up included: first with an empty XLA cache, then with the programs
  the first run kept.

No timed call is given a batch of text given before (the rule `common.Fed` keeps for the other
scripts: a compiled program fed the same tensors again can hide a recompilation). Above batch
1, each round feeds every batch's reviews rotated by the round's number: the same reviews, so
the same length groups and the XLA programs the warm-up pass compiled, in a new order. At
batch 1 the warm-up and each round take reviews of their own, and so do the latency blocks
and the interleaved calls.

Usage:
    python benchmarks/serving.py --data_dir ../shared/data/tensorflow_datasets
    python benchmarks/serving.py --rounds 5 --output BENCHMARKS.md
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least_one, cpu_name, replace_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- serving:start -->", "<!-- serving:end -->"
SIGNATURES = ("serving_default", "inspect")


def rate(signature, texts, batch_size, turn=0):
    """Reviews per second through `signature` over `texts`, in order, `batch_size` a call,
    each batch's reviews rotated by `turn` (the same reviews, in another order)."""
    import tensorflow as tf

    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    batches = [batch[turn % len(batch) :] + batch[: turn % len(batch)] for batch in batches]
    start = time.perf_counter()
    for batch in batches:
        signature(text=tf.constant(batch))
    return len(texts) / (time.perf_counter() - start)


def reviews_at(texts, start, count):
    """`count` of `texts` from `start` on, wrapping around at the end."""
    return [texts[(start + i) % len(texts)] for i in range(count)]


def latencies(signature, texts):
    """Seconds per call, one review a call."""
    import tensorflow as tf

    out = []
    for text in texts:
        start = time.perf_counter()
        signature(text=tf.constant([text]))["probability"].numpy()
        out.append(time.perf_counter() - start)
    return out


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def predict_end_to_end(model, path, count, cache):
    """Seconds for `python -m apps.predict --input path --json` to answer every review."""
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "apps.predict",
            "--model",
            model,
            "--input",
            path,
            "--json",
            "--xla_cache",
            cache,
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=3600,
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(result.stderr.decode()[-2000:])
    answered = result.stdout.count(b"\n")
    if answered != count:
        raise RuntimeError(f"apps.predict answered {answered} of {count} reviews")
    return seconds


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "saved_models/imdb_sdpa/saved_model"))
    parser.add_argument("--data_dir", default=os.environ.get("TFDS_DATA_DIR"))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch size")
    parser.add_argument("--reviews", type=int, default=2048, help="reviews per round")
    parser.add_argument("--latency_reviews", type=int, default=300)
    parser.add_argument(
        "--latency_block", type=int, default=50, help="one-review calls of a signature in a row"
    )
    parser.add_argument("--skip_predict", action="store_true", help="skip the 25,000-review run")
    parser.add_argument("--output", help="a Markdown file whose serving section is replaced")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds", "reviews", "latency_reviews", "latency_block")
    return args


def round_reviews(args, texts, batch_size, count, index):
    """The reviews of the warm-up (`index` 0) or of round `index`, and how far each batch of
    them is rotated: above batch 1 the first `count`, rotated by `index`; at batch 1 `count`
    reviews of their own, after the first `--reviews`."""
    if batch_size > 1:
        return texts[:count], index
    return reviews_at(texts, args.reviews + index * count, count), 0


def measure_rates(args, signatures, texts):
    """`(batch size, reviews, {signature: rates}, ratios)` at batch 256, 32 and 1, and where
    in `texts` the reviews it did not use begin (`round_reviews`: no call repeats a batch)."""
    rows = []
    for batch_size in (256, 32, 1):
        count = args.reviews if batch_size > 1 else min(args.reviews, 256)
        warm_up, _ = round_reviews(args, texts, batch_size, count, 0)
        for signature in signatures.values():  # warm-up: XLA compiles each shape once
            rate(signature, warm_up, batch_size)
        rates = {name: [] for name in SIGNATURES}
        for index in range(args.rounds):
            reviews, turn = round_reviews(args, texts, batch_size, count, index + 1)
            order = SIGNATURES if index % 2 == 0 else SIGNATURES[::-1]
            for name in order:
                rates[name].append(rate(signatures[name], reviews, batch_size, turn))
            print(
                f"  batch {batch_size}, round {index + 1}/{args.rounds}: "
                + ", ".join(f"{n} {rates[n][-1]:.0f}/s" for n in SIGNATURES),
                file=sys.stderr,
            )
        ratios = [a / b for a, b in zip(rates["serving_default"], rates["inspect"])]
        rows.append((batch_size, count, rates, ratios))
    return rows, args.reviews + (args.rounds + 1) * min(args.reviews, 256)


def measure_latencies(args, signatures, texts, start):
    """Seconds per one-review call of each signature: in alternating blocks of one signature,
    on the `--latency_reviews` reviews of `texts` from `start` on; and with the two
    interleaved call by call, on as many reviews after those."""
    reviews = reviews_at(texts, start, args.latency_reviews)
    delays = {name: [] for name in SIGNATURES}  # blocks of one signature
    for index, first in enumerate(range(0, len(reviews), args.latency_block)):
        for name in SIGNATURES if index % 2 == 0 else SIGNATURES[::-1]:
            delays[name].extend(
                latencies(signatures[name], reviews[first : first + args.latency_block])
            )
    mixed = {name: [] for name in SIGNATURES}  # the two interleaved call by call
    reviews = reviews_at(texts, start + args.latency_reviews, args.latency_reviews)
    for i, text in enumerate(reviews):
        for name in SIGNATURES if i % 2 == 0 else SIGNATURES[::-1]:
            mixed[name].extend(latencies(signatures[name], [text]))
    return delays, mixed


def measure_predict(args, texts):
    """`(label, seconds)` of `apps.predict` on every text: with an empty XLA cache, then with
    the one the first run kept."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "reviews.txt")
        with open(path, "wb") as f:
            f.writelines(t.replace(b"\n", b" ").replace(b"\r", b" ") + b"\n" for t in texts)
        cache = os.path.join(folder, "xla")
        for label in ("empty XLA cache", "XLA cache kept by the first run"):
            seconds = predict_end_to_end(args.model, path, len(texts), cache)
            rows.append((label, seconds))
            print(f"  apps.predict, {label}: {seconds:.1f} s", file=sys.stderr)
    return rows


def rate_lines(args, rows):
    """The section's title, what it measured, and the table of reviews/s."""
    command = f"    python benchmarks/serving.py --rounds {args.rounds} --output BENCHMARKS.md"
    lines = [
        "## Serving the SavedModel",
        "",
        "Produced by:",
        "",
        command,
        "",
        f"On {cpu_name()}. "
        "The shipped SavedModel loaded with plain TensorFlow (no `keras_sdpa` in the process), "
        f"IMDB test reviews in the split's order. `serving_default` returns the label and "
        "probability and computes each review at its length bucket; `inspect` returns the "
        "tokens and every attention weight at 512 positions, as `serving_default` did before. "
        f"{args.rounds} alternating rounds of {args.reviews} reviews (256 at batch 1) after one "
        "warm-up pass that compiles; ratio = median of the per-round ratios (range). No call "
        "is given a batch of text it was given before (a compiled program fed the same "
        "tensors again can hide a recompilation): each round feeds every batch's reviews "
        "rotated by the round's number (the same reviews, so the same length groups and XLA "
        "programs as the warm-up pass, in a new order); at batch 1 the warm-up and each round "
        "take reviews of their own.",
        "",
        "| batch | serving_default reviews/s | inspect reviews/s | ratio |",
        "|---|---|---|---|",
    ]
    for batch_size, _, rates, ratios in rows:
        lines.append(
            f"| {batch_size} | {statistics.median(rates['serving_default']):.0f} | "
            f"{statistics.median(rates['inspect']):.0f} | **{statistics.median(ratios):.2f}** "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return lines


def latency_lines(args, delays, mixed, predict_rows, count):
    """The tables of latency and, when it ran, of `apps.predict` on `count` reviews."""
    lines = [
        "",
        f"One review a call, {args.latency_reviews} reviews: in blocks of {args.latency_block} "
        "calls of one signature, the blocks alternating between the two (a service that "
        "serves one); and interleaved call by call, on another "
        f"{args.latency_reviews} reviews, so that no signature is given a review twice (a "
        "service that mixes them, each call finding the caches the other left):",
        "",
        "| signature | p50 ms | p99 ms | interleaved p50 ms | interleaved p99 ms |",
        "|---|---|---|---|---|",
    ]
    for name in SIGNATURES:
        lines.append(
            f"| {name} | {percentile(delays[name], 0.5) * 1e3:.2f} | "
            f"{percentile(delays[name], 0.99) * 1e3:.2f} | "
            f"{percentile(mixed[name], 0.5) * 1e3:.2f} | "
            f"{percentile(mixed[name], 0.99) * 1e3:.2f} |"
        )
    if predict_rows:
        lines += [
            "",
            f"`python -m apps.predict --input FILE --json` on all {count:,} test reviews, "
            "start-up (TensorFlow import, SavedModel load, XLA compilation) included:",
            "",
            "| run | seconds | reviews/s |",
            "|---|---|---|",
        ]
        for label, seconds in predict_rows:
            lines.append(f"| {label} | {seconds:.1f} | {count / seconds:.0f} |")
    return lines


def main(argv=None):
    args = parse_arguments(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tensorflow_datasets as tfds

    builder = tfds.builder("imdb_reviews", data_dir=args.data_dir)
    texts = list(tfds.as_numpy(builder.as_dataset(split="test", batch_size=-1))["text"])
    loaded = tf.saved_model.load(args.model)
    signatures = {name: loaded.signatures[name] for name in SIGNATURES}
    rows, unused = measure_rates(args, signatures, texts)
    delays, mixed = measure_latencies(args, signatures, texts, unused)
    predict_rows = [] if args.skip_predict else measure_predict(args, texts)
    assert "keras_sdpa" not in sys.modules, "the benchmark imported keras_sdpa"

    lines = rate_lines(args, rows) + latency_lines(args, delays, mixed, predict_rows, len(texts))
    section = "\n".join(lines) + "\n"
    print(section)
    if args.output:
        replace_section(args.output, START, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
