"""The attention viewer: a self-contained `attention.html`, and a CLI that makes one.

Usage:
    python -m apps.viewer                                   # saved_models/imdb_sdpa
    python -m apps.viewer --model saved_models/imdb_sdpa --examples 100
    python -m apps.viewer --screenshot viewer.png --view "review=1&layer=0&head=1"

The training app writes `attention.html` at the end of every run. This CLI writes
it again from a SavedModel alone, with plain TensorFlow: it serves a seeded sample
of test reviews through the `inspect` signature (which returns the tokens and the
weights) and writes `attention.jsonl` and `attention.html` beside the model.
The page is one file with the data embedded as JSON and no network fetches; its
address keeps the view (`attention.html#review=1&layer=0&head=1&token=5`), so a
link shows what you saw. `--screenshot` also saves a headless-Chromium PNG of it.
The page itself is `apps/inspection/page.py`.
"""

import argparse
import json
import os
import sys
import tempfile

from .records import inspection_sample, make_record, write_attention_html, write_attention_jsonl

# Chromium's flags for these machines: headless, no sandbox (root), and no background
# connections (the network is closed, and Chromium would keep retrying).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
)


def records_from_saved_model(serve, texts, labels, indices=None, batch_size=8):
    """`apps.serving.make_record` for each review, from a SavedModel's `inspect` signature
    (`serve`), cut to each review's real tokens. `indices` as for `inspect_records`."""
    import tensorflow as tf

    indices = list(range(len(texts)) if indices is None else indices)
    records = []
    for start in range(0, len(texts), batch_size):
        batch = list(texts[start : start + batch_size])
        out = serve(text=tf.constant(batch))
        for i, text in enumerate(batch):
            n = int(out["length"][i])
            records.append(
                make_record(
                    indices[start + i],
                    text,
                    [t.decode("utf-8") for t in out["tokens"][i, :n].numpy()],
                    labels[start + i],
                    float(out["probability"][i]),
                    out["pooling"][i, :, :n].numpy(),
                    out["attention"][i, :, :, :n, :n].numpy(),
                )
            )
    return records


def chromium(width=1200, height=900, binary=None, driver=None):
    """A headless Chromium driven by Selenium through Debian's `chromium-driver`.

    `binary` and `driver` default to `$CHROMIUM`/`$CHROMEDRIVER`, then to the first
    `chromium` and `chromedriver` on the PATH. Raises `RuntimeError` naming what to
    install when either is missing (Selenium's own browser download needs a network).
    """
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = binary or os.environ.get("CHROMIUM") or shutil.which("chromium")
    driver = driver or os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    if not binary or not driver:
        raise RuntimeError(
            f"headless Chromium needs a browser and its driver; found chromium={binary!r}, "
            f"chromedriver={driver!r}. On Debian or Ubuntu: "
            "`apt-get install chromium chromium-driver`; elsewhere set $CHROMIUM and $CHROMEDRIVER."
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}")
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(driver), options=options)


def screenshot(page, path, view="", width=1200, height=900):
    """Opens `page` (a file path) at `view` (`"review=1&layer=0&head=1"`) in headless
    Chromium and saves a PNG of it to `path`."""
    browser = chromium(width, height)
    try:
        browser.get("file://" + os.path.abspath(page) + ("#" + view.lstrip("#") if view else ""))
        browser.save_screenshot(path)
    finally:
        browser.quit()
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m apps.viewer",
        description="Write attention.html (and attention.jsonl) from a SavedModel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="saved_models/imdb_sdpa", help="run folder")
    parser.add_argument("--examples", type=int, default=50, help="test reviews to export")
    parser.add_argument("--dataset", default=None, help="default: the run's metrics.json")
    parser.add_argument("--data_dir", default=None, help="TFDS folder; else $TFDS_DATA_DIR")
    parser.add_argument("--seed", type=int, default=None, help="default: the run's seed")
    parser.add_argument("--output", default=None, help="folder; default: --model")
    parser.add_argument("--screenshot", default=None, help="also save a PNG of the page here")
    parser.add_argument(
        "--view",
        default="",
        help="the screenshot's view, as in the page's address: \"review=1&layer=0&head=1\"",
    )
    args = parser.parse_args(argv)
    if args.examples <= 0:
        parser.error(f"`--examples` must be positive. Received: examples={args.examples}")
    return args


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from ..classifier import data
    from ..serving.predict import resolve_model_path

    try:
        model_path = resolve_model_path(args.model)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = {}
    metrics_path = os.path.join(args.model, "metrics.json")
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            config = json.load(f)["config"]
    dataset = args.dataset or config.get("dataset", "imdb_reviews")
    seed = config.get("seed", 0) if args.seed is None else args.seed
    try:
        splits = data.load_splits(dataset, args.data_dir, seed=seed)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # The same seeded sample as the training app's own export.
    chosen = inspection_sample(len(splits.test_text), args.examples, seed)
    print(f"Serving {len(chosen)} {dataset} test reviews through {model_path}")
    loaded = tf.saved_model.load(model_path)
    signatures = loaded.signatures
    # `inspect` returns the tokens and weights; models exported before it, `serving_default`.
    inspect = signatures["inspect"] if "inspect" in signatures else signatures["serving_default"]
    records = records_from_saved_model(
        inspect, splits.test_text[chosen], splits.test_label[chosen], chosen
    )
    output = args.output or args.model
    os.makedirs(output, exist_ok=True)
    paths = [
        write_attention_jsonl(records, os.path.join(output, "attention.jsonl")),
        write_attention_html(
            records,
            os.path.join(output, "attention.html"),
            title=f"keras-sdpa attention: {dataset} test reviews",
        ),
    ]
    if args.screenshot:
        try:
            paths.append(screenshot(paths[1], args.screenshot, args.view))
        except (ImportError, RuntimeError) as error:
            print(f"error: no screenshot: {error}", file=sys.stderr)
            return 1
    print("Wrote:")
    for path in paths:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
