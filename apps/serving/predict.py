"""Classify raw reviews with an exported SavedModel, using TensorFlow only.

Usage:
    python -m apps.predict "A wonderful, moving film." "Dull and far too long."
    python -m apps.predict --json < reviews.txt         # one review per line
    python -m apps.predict --input reviews.txt --json > labels.jsonl
    python -m apps.predict --explain "..."              # and the most attended tokens
    python -m apps.predict --model path/to/saved_model "..."

Reviews come from the arguments, from `--input FILE` or from stdin, one per line. They
are classified in batches of `--batch_size`, each of one length bucket (so XLA compiles one
program per bucket), `--workers` batches at once, and written in input order: plain text, or
one JSON object per line with `--json`. A progress bar goes to stderr when there are more
reviews than one batch.

`serving_default` gives the label and probability. `--explain` uses the `inspect`
signature, which also returns the tokens and the pooling attention, and adds each
review's most attended tokens; it is slower (every review at the full length, with the
weights). This module never imports keras_sdpa or Keras: the SavedModel written by
`apps.train_sentiment` carries its own tokenizer and the XLA attention.
"""

import argparse
import collections
import concurrent.futures
import hashlib
import importlib.metadata
import itertools
import json
import multiprocessing
import os
import platform
import sys
import time

from ..classifier import buckets
from .native_log import native_log_set_aside

DEFAULT_MODEL = "saved_models/imdb_sdpa"
# XLA compiles the model once per review length bucket and batch shape; a persistent cache
# keeps the programs for the next run (25,000 reviews: 37.3 s cold, 27.8 s with it;
# BENCHMARKS.md). Its programs are machine code for one CPU: `cache_folder` keeps one folder
# per CPU and TensorFlow version under it.
DEFAULT_XLA_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "keras_sdpa", "xla")
BATCH_SIZE = 256  # measured: 32 reads at half the rate of 256 on 2 cores (BENCHMARKS.md)
# Batches computed at once: one per core. A batch of one length bucket runs its row steps
# on one core (apps.serving.compiled.compiled_classifier).
WORKERS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
CHUNK_BATCHES = 128  # batches read, grouped by length and written at a time


def resolve_model_path(path, flag="model"):
    """`path` itself if it is a SavedModel, else `path/saved_model` (a training run's folder).
    `flag` is the command-line flag that gave `path`, named in the error."""
    for candidate in (path, os.path.join(path, "saved_model")):
        if os.path.isfile(os.path.join(candidate, "saved_model.pb")):
            return candidate
    raise ValueError(
        f"`--{flag}` is not a SavedModel nor a run folder holding one. Received: {flag}={path!r}. "
        "Train one with `python -m apps.train_sentiment`."
    )


def load(path):
    """`(serving_default, inspect)` of a SavedModel. A model exported before `inspect`
    existed returned everything from `serving_default`: it serves both then."""
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    signatures = loaded.signatures
    serve = signatures["serving_default"]
    inspect = signatures["inspect"] if "inspect" in signatures else serve
    return loaded, serve, inspect


# The lines of /proc/cpuinfo that say what a CPU is and can do: x86's, then Arm's.
_CPU_FIELDS = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")


def _cpu():
    """What the CPU is and can do: the machine, and its model and features as /proc/cpuinfo
    gives them (Linux on x86 or Arm), else what `platform` knows."""
    lines = [f"{platform.machine()} {platform.processor()}\n"]
    try:
        with open("/proc/cpuinfo") as f:
            lines += sorted({line for line in f if line.startswith(_CPU_FIELDS)})
    except OSError:
        pass
    return "".join(lines)


def _tensorflow_version():
    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly"):
        try:
            return f"{name}-{importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "tensorflow-unknown"


def cache_folder(root):
    """`root/<TensorFlow version>-<CPU digest>`: XLA's cached programs are machine code for the
    CPU that compiled them, so a home shared between machines never loads another CPU's (what
    TensorFlow's "could lead to execution errors such as SIGILL" warning is about), and a new
    TensorFlow never reads an old one's."""
    digest = hashlib.sha256(_cpu().encode()).hexdigest()[:12]
    return os.path.join(root, f"{_tensorflow_version()}-cpu-{digest}")


def use_xla_cache(folder):
    """Keeps XLA's compiled programs in `cache_folder(folder)` across runs (TensorFlow's
    `--tf_xla_persistent_cache_directory`); before TensorFlow is imported, and not over a
    cache the caller already set in `TF_XLA_FLAGS`."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    if not folder or "tf_xla_persistent_cache_directory" in flags:
        return
    if "tensorflow" in sys.modules:
        return  # too late: TensorFlow reads its flags once
    folder = cache_folder(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return  # a read-only home: run without the cache
    os.environ["TF_XLA_FLAGS"] = f"{flags} --tf_xla_persistent_cache_directory={folder}".strip()


def _as_bytes(text):
    """Raw bytes of a review: str from argv (undecodable bytes kept) or bytes from a file."""
    if isinstance(text, bytes):
        return text
    return os.fsencode(text)


def batches(texts, batch_size, fill=False, counts=None):
    """Lists of indices into `texts` (bytes), one list a call: reviews of one length bucket
    each (`apps.classifier.buckets`, by `count_tokens`, or the word `counts` given), so that
    `serving_default` computes a batch as one group, at one length. With `fill`, a bucket's
    last, short batch repeats its last review up to `batch_size`: every call then has the
    same shape, and XLA compiles one program per bucket, not one per remainder (about a
    second each). A bucket's first batch comes before the rest of the previous bucket's, so
    that its program compiles while other workers compute."""
    if counts is None:
        counts = count_words(texts)
    bucket = [buckets.bucket_of(n) for n in counts]
    order = sorted(range(len(texts)), key=lambda i: (bucket[i], len(texts[i])))
    groups = []
    for _, members in itertools.groupby(order, key=bucket.__getitem__):
        members = list(members)
        groups.append([])
        for start in range(0, len(members), batch_size):
            chosen = members[start : start + batch_size]
            groups[-1].append(chosen + chosen[-1:] * (batch_size - len(chosen)) if fill else chosen)
    out = groups[0][:1] if groups else []
    for index, group in enumerate(groups):
        out += groups[index + 1][:1] if index + 1 < len(groups) else []
        out += group[1:]
    return out


def count_words(texts):
    """`buckets.count_tokens` of each review (bytes)."""
    return [buckets.count_tokens(t) for t in texts]


def _count_aside(texts):
    """A future of `count_words(texts)`, counted in a forked process while this one imports
    TensorFlow and loads the model (25,000 reviews: 1.2 s, on another core); None where
    TensorFlow is already imported (forking its threads is unsafe) or there is no fork."""
    if "tensorflow" in sys.modules or "fork" not in multiprocessing.get_all_start_methods():
        return None
    try:
        pool = concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("fork"))
        future = pool.submit(count_words, texts)
    except OSError:
        return None  # no process to spare: count in this one
    pool.shutdown(wait=False)
    return future


def _counted(future):
    """The counts of a `_count_aside` future, or None (count here) if its process failed."""
    if future is None:
        return None
    try:
        return future.result()
    except (OSError, concurrent.futures.process.BrokenProcessPool):
        return None


def _calls(signature, texts, plan, workers):
    """`(indices, outputs)` for each batch of `plan`, in order, computed by `workers` threads:
    TensorFlow runs their calls at once (a length bucket's batch runs its steps on one core).
    Up to twice as many batches are queued, so a worker goes on while another waits for a
    program to compile, and no more answers than that are held."""
    import tensorflow as tf

    def call(chosen):
        return signature(text=tf.constant([texts[i] for i in chosen], dtype=tf.string))

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending = collections.deque()
        for chosen in plan:
            pending.append((chosen, pool.submit(call, chosen)))
            if len(pending) == 2 * workers:
                chosen, future = pending.popleft()
                yield chosen, future.result()
        while pending:
            chosen, future = pending.popleft()
            yield chosen, future.result()


def predict(
    signature,
    texts,
    top_k=0,
    max_bytes=8 << 20,
    batch_size=BATCH_SIZE,
    workers=WORKERS,
    on_batch=None,
    counts=None,
):
    """One dict per review, in order: label, probability, number of tokens read and, with
    `top_k > 0` (`signature` must then be `inspect`), the most attended tokens.

    More reviews than one batch are sent in batches of one length bucket each (`batches`),
    of `batch_size` each with `serving_default`, up to `workers` at once; one batch is sent
    as it is. `on_batch(n)` is called after each batch with the number of reviews it answered.
    `counts`, if given, are `count_words` of the reviews cut to `max_bytes`.
    """
    raw = [_as_bytes(t) for t in texts]
    cut = [text[:max_bytes] for text in raw]
    if len(raw) > batch_size:
        plan = batches(cut, batch_size, fill=not top_k, counts=counts)
    else:
        plan = [list(range(len(raw)))]
    results = [None] * len(raw)
    for chosen, out in _calls(signature, cut, plan, workers):
        probability = out["probability"].numpy()
        lengths = out["length"].numpy()
        if top_k:
            tokens = out["tokens"].numpy()
            pooling = out["pooling"].numpy().mean(axis=1)  # (B, L), averaged over heads
        for row, i in enumerate(chosen):
            if results[i] is not None:
                continue  # a repeat that filled the batch
            n = int(lengths[row])
            result = {
                "text": raw[i].decode("utf-8", errors="replace"),
                "label": "positive" if probability[row] >= 0.5 else "negative",
                "probability": round(float(probability[row]), 6),
                "tokens": n,
            }
            if top_k:
                weight_by_token = {}
                for token, weight in zip(tokens[row, :n], pooling[row, :n]):
                    token = token.decode("utf-8", errors="replace")
                    weight_by_token[token] = weight_by_token.get(token, 0.0) + float(weight)
                top = sorted(weight_by_token.items(), key=lambda item: -item[1])[:top_k]
                result["top_tokens"] = [{"token": t, "weight": round(w, 4)} for t, w in top]
            if n == 0:
                result["note"] = "no known words in the review; the label is the model's prior"
            if len(raw[i]) > max_bytes:
                result["note"] = f"read the first {max_bytes} of {len(raw[i])} bytes"
            results[i] = result
        if on_batch:
            on_batch(len(set(chosen)))
    return results


def _json_line(result):
    """One JSON object on one line: the line separators that some readers split on
    (U+0085, U+2028, U+2029; `str.splitlines` does) are written as escapes."""
    line = json.dumps(result, ensure_ascii=False)
    for char in "\u0085\u2028\u2029":
        line = line.replace(char, f"\\u{ord(char):04x}")
    return line


def _format(result, width=60):
    text = " ".join(result["text"].split())
    if len(text) > width:
        text = text[: width - 3] + "..."
    line = f"{result['label']:8s} {result['probability']:.3f}  "
    if "top_tokens" in result:
        top = ", ".join(f"{t['token']} {t['weight']:.2f}" for t in result["top_tokens"]) or "-"
        line += f"[{top}]  "
    line += repr(text)
    if "note" in result:
        line += f"  ({result['note']})"
    return line


class _Progress:
    """A one-line progress bar on stderr: reviews done, rate, time left."""

    def __init__(self, total, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.started = time.perf_counter()

    def add(self, count):
        self.done += count
        elapsed = time.perf_counter() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (
            ""
            if self.total is None or not rate
            else f", {(self.total - self.done) / rate:.0f} s left"
        )
        total = "" if self.total is None else f"/{self.total}"
        self.stream.write(f"\r{self.done}{total} reviews, {rate:.0f}/s{left}   ")
        self.stream.flush()

    def close(self):
        self.stream.write("\n")
        self.stream.flush()


def _chunks(lines, size):
    chunk = []
    for line in lines:
        chunk.append(line.rstrip(b"\r\n"))
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m apps.predict",
        description="Classify raw reviews with a SavedModel from apps.train_sentiment.",
        epilog="Each answer is the label, then the probability that the review is positive. "
        "It is calibrated on whole reviews held out from training (a temperature, fitted after "
        "training): of the IMDB test reviews given about 0.8, about 80% are positive. A "
        "negative label comes with a probability below 0.5. The model learned from long "
        "reviews, and reads a single sentence less surely (its model card's 'Short reviews').",
    )
    parser.add_argument(
        "texts", nargs="*", help="reviews; none reads one review per line from --input or stdin"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="SavedModel or training run folder")
    parser.add_argument("--input", help="a file of reviews, one per line")
    parser.add_argument("--json", action="store_true", help="one JSON object per review per line")
    parser.add_argument(
        "--explain", action="store_true", help="add the most attended tokens (slower)"
    )
    parser.add_argument("--top_k", type=int, default=5, help="most attended tokens to show")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE, help="reviews per call")
    parser.add_argument(
        "--workers", type=int, default=WORKERS, help="batches computed at once (default: cores)"
    )
    parser.add_argument("--max_bytes", type=int, default=8 << 20, help="bytes read per review")
    parser.add_argument(
        "--xla_cache",
        default=DEFAULT_XLA_CACHE,
        help="folder for XLA's compiled programs, kept between runs ('' = none)",
    )
    parser.add_argument(
        "--tf_log", action="store_true", help="show TensorFlow's own log lines on stderr"
    )
    args = parser.parse_args(argv)
    with native_log_set_aside(keep=args.tf_log):
        return _main(args)


def _main(args):
    source = None
    try:
        if args.top_k < 0:
            raise ValueError(f"`--top_k` must be >= 0. Received: top_k={args.top_k}")
        if args.batch_size < 1:
            raise ValueError(f"`--batch_size` must be >= 1. Received: batch_size={args.batch_size}")
        if args.workers < 1:
            raise ValueError(f"`--workers` must be >= 1. Received: workers={args.workers}")
        if args.max_bytes <= 0:
            raise ValueError(
                f"`--max_bytes` must be positive. Received: max_bytes={args.max_bytes}"
            )
        if args.texts and args.input:
            raise ValueError(
                "give reviews as arguments or with --input, not both. "
                f"Received: input={args.input!r}"
            )
        path = resolve_model_path(args.model)
        if args.texts:
            total, chunks = len(args.texts), iter([list(args.texts)])
        else:
            if args.input:
                try:
                    source = open(args.input, "rb")
                except OSError as error:
                    raise ValueError(
                        f"`--input` cannot be read ({error.strerror}). "
                        f"Received: input={args.input!r}"
                    ) from None
                total = sum(1 for _ in source)
                source.seek(0)
            elif sys.stdin.isatty():
                raise ValueError(
                    "give reviews as arguments, with --input FILE, or one per line on stdin"
                )
            else:
                source, total = sys.stdin.buffer, None
            chunks = _chunks(source, args.batch_size * CHUNK_BATCHES)
        # The first chunk's words are counted on another core while TensorFlow loads.
        first = next(chunks, [])
        counting = None
        if len(first) > args.batch_size and not args.explain:
            counting = _count_aside([_as_bytes(t)[: args.max_bytes] for t in first])
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        use_xla_cache(args.xla_cache)
        try:
            _, serve, inspect = load(path)
        except Exception as error:  # a corrupt or foreign file: TensorFlow's own error
            raise ValueError(
                f"`--model` could not be loaded as a SavedModel ({type(error).__name__}: "
                f"{str(error)[:300]}). Received: model={args.model!r}"
            ) from None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    top_k = args.top_k if args.explain else 0
    signature = inspect if args.explain else serve
    progress = None if total is not None and total <= args.batch_size else _Progress(total)
    try:
        for index, chunk in enumerate(itertools.chain([first] if first else [], chunks)):
            results = predict(
                signature,
                chunk,
                top_k,
                args.max_bytes,
                args.batch_size,
                args.workers,
                on_batch=progress.add if progress else None,
                counts=_counted(counting) if index == 0 else None,
            )
            sys.stdout.write(
                "".join((_json_line(r) if args.json else _format(r)) + "\n" for r in results)
            )
    finally:
        if progress:
            progress.close()
        if source is not None and source is not sys.stdin.buffer:
            source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
