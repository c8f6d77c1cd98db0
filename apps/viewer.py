"""The attention viewer: a self-contained `attention.html`, and a CLI that makes one.

Usage:
    python -m apps.viewer                                   # saved_models/imdb_sdpa
    python -m apps.viewer --model saved_models/imdb_sdpa --examples 100
    python -m apps.viewer --screenshot viewer.png --view "review=1&layer=0&head=1"

The training app writes `attention.html` at the end of every run. This CLI writes
it again from a SavedModel alone, with plain TensorFlow: it serves a seeded sample
of test reviews through `serving_default` (which returns the tokens and the
weights) and writes `attention.jsonl` and `attention.html` beside the model.
The page is one file with the data embedded as JSON and no network fetches; its
address keeps the view (`attention.html#review=1&layer=0&head=1&token=5`), so a
link shows what you saw. `--screenshot` also saves a headless-Chromium PNG of it.
`TEMPLATE` is the page; `__DATA__` is replaced by the JSON.
"""

import argparse
import json
import os
import sys
import tempfile

# Chromium's flags for these machines: headless, no sandbox (root), and no background
# connections (the network is closed, and Chromium would keep retrying).
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-quic",
)  # fmt: skip


TEMPLATE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #fafafa; }
  header { padding: 12px 16px; background: #24292f; color: #fff; }
  header h1 { font-size: 18px; margin: 0 0 4px 0; }
  header p { margin: 0; font-size: 13px; opacity: 0.85; }
  .controls { display: flex; flex-wrap: wrap; gap: 8px; padding: 10px 16px; align-items: center;
              background: #fff; border-bottom: 1px solid #ddd; position: sticky; top: 0; }
  .controls label { font-size: 13px; }
  .controls select, .controls input, .controls button { font-size: 14px; padding: 4px 6px; }
  main { padding: 12px 16px; max-width: 1100px; }
  .meta { font-size: 14px; margin-bottom: 8px; }
  .badge { display: inline-block; padding: 2px 8px; border-radius: 10px; color: #fff; font-size: 13px; }
  .pos { background: #1a7f37; } .neg { background: #cf222e; }
  .right { background: #0969da; } .wrong { background: #bf8700; }
  #tokens { line-height: 1.9; font-size: 15px; background: #fff; padding: 10px; border: 1px solid #ddd;
            border-radius: 6px; overflow-wrap: anywhere; }
  .tok { padding: 2px 1px; border-radius: 3px; cursor: pointer; }
  .tok.selected { outline: 2px solid #d1242f; }
  #hint, #legend { font-size: 13px; color: #57606a; margin: 6px 0; }
  .swatch { display: inline-block; width: 14px; height: 14px; border: 1px solid #ccc; vertical-align: middle; }
  canvas { border: 1px solid #ddd; max-width: 100%; image-rendering: pixelated; background: #fff; }
  @media (max-width: 600px) {
    main, .controls { padding-left: 8px; padding-right: 8px; }
    #tokens { font-size: 14px; }
    .controls input { width: 9em; }
  }
  details { margin-top: 10px; font-size: 14px; }
  .text { white-space: pre-wrap; font-size: 13px; color: #57606a; }
</style>
</head>
<body>
<header>
  <h1>__TITLE__</h1>
  <p>Each token is shaded by the attention it receives. Click a token to see what it attends to
     (its row of the self-attention matrix); &larr; and &rarr; move between reviews. Padding is never shown.</p>
</header>
<div class="controls">
  <button id="prev" aria-label="previous review">&larr; prev</button>
  <span id="position"></span>
  <button id="next" aria-label="next review">next &rarr;</button>
  <label>show <select id="filter">
    <option value="all">all</option><option value="correct">correct</option>
    <option value="wrong">wrong</option><option value="confident">most confident</option>
    <option value="unsure">least confident</option></select></label>
  <label>search <input id="search" type="search" placeholder="words in the review"></label>
  <label>layer <select id="layer"></select></label>
  <label>head <select id="head"></select></label>
  <label id="shading-control" hidden>shading <select id="shading">
    <option value="attention">attention</option>
    <option value="gradient">gradient &times; input</option></select></label>
</div>
<main>
  <div class="meta" id="meta"></div>
  <div class="meta" id="deletion"></div>
  <div id="tokens"></div>
  <div id="hint"></div>
  <div id="legend"></div>
  <canvas id="heatmap" width="300" height="300"></canvas>
  <details><summary>original text</summary><div class="text" id="text"></div></details>
</main>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const EXAMPLES = DATA.examples;
const NUM_LAYERS = EXAMPLES.length ? EXAMPLES[0].rows.length : 0;
const NUM_HEADS = EXAMPLES.length ? EXAMPLES[0].pooling.length : 0;
// Gradient x input comes with the runs that had the Keras model (the training app).
const HAS_GRADIENT = EXAMPLES.length > 0 && EXAMPLES.every(ex => Array.isArray(ex.gradient));
// layer: "pooling" or a block index; selected: the clicked token, whose row is shown;
// shading: "attention" (the layer's weights) or "gradient" (gradient x input).
const state = { order: [], position: 0, layer: "pooling", head: 0, selected: null, shading: "attention" };

function decodeRows(ex, layer, head) {
  // The (n, n) self-attention of one head: bytes scaled per row, times the row's maximum.
  const n = ex.tokens.length, bytes = atob(ex.rows[layer][head]), maxima = ex.row_max[layer][head];
  const out = new Float32Array(n * n);
  for (let i = 0; i < bytes.length; i++) out[i] = (bytes.charCodeAt(i) / 255) * maxima[Math.floor(i / n)];
  return out;
}
function viewWeights(ex) {
  // The per-token shading: gradient x input, pooling weights, attention received, or the clicked token's row.
  if (state.shading === "gradient") return ex.gradient;
  if (state.layer === "pooling") return ex.pooling[state.head];
  if (state.selected !== null) {
    const n = ex.tokens.length, rows = decodeRows(ex, state.layer, state.head);
    return Array.from(rows.slice(state.selected * n, state.selected * n + n));
  }
  return ex.received[state.layer][state.head];
}
function applyFilter() {
  const filter = document.getElementById("filter").value;
  const query = document.getElementById("search").value.trim().toLowerCase();
  let order = EXAMPLES.map((_, i) => i);
  if (filter === "correct") order = order.filter(i => EXAMPLES[i].label === EXAMPLES[i].prediction);
  if (filter === "wrong") order = order.filter(i => EXAMPLES[i].label !== EXAMPLES[i].prediction);
  const confidence = i => Math.abs(EXAMPLES[i].probability - 0.5);
  if (filter === "confident") order.sort((x, y) => confidence(y) - confidence(x));
  if (filter === "unsure") order.sort((x, y) => confidence(x) - confidence(y));
  if (query) order = order.filter(i => EXAMPLES[i].text.toLowerCase().includes(query));
  state.order = order; state.position = 0; state.selected = null; render();
}
function select(i) {
  // A click shows attention: the token's row. Pooling has no rows (one learned query):
  // from there a click shows the token's row in the last block.
  state.shading = "attention"; document.getElementById("shading").value = "attention";
  if (state.layer === "pooling" && NUM_LAYERS) {
    state.layer = NUM_LAYERS - 1; document.getElementById("layer").value = String(state.layer);
  }
  state.selected = state.selected === i ? null : i; render();
}
function render() {
  const position = document.getElementById("position");
  const tokens = document.getElementById("tokens");
  position.textContent = state.order.length ? `${state.position + 1} / ${state.order.length}` : "0 / 0";
  position.dataset.count = state.order.length;
  tokens.innerHTML = "";
  document.getElementById("prev").disabled = state.position <= 0;
  document.getElementById("next").disabled = state.position >= state.order.length - 1;
  if (!state.order.length) {
    document.getElementById("meta").textContent = "No review matches.";
    document.getElementById("hint").textContent = "";
    document.getElementById("legend").textContent = ""; drawHeatmap(null); return;
  }
  const index = state.order[state.position], ex = EXAMPLES[index];
  tokens.dataset.example = index;
  const label = ex.label ? "positive" : "negative", predicted = ex.prediction ? "positive" : "negative";
  const correct = ex.label === ex.prediction;
  document.getElementById("meta").innerHTML =
    `review #${index} &middot; label <span class="badge ${ex.label ? "pos" : "neg"}">${label}</span> ` +
    `predicted <span class="badge ${ex.prediction ? "pos" : "neg"}">${predicted}</span> ` +
    `P(positive) = ${ex.probability.toFixed(3)} ` +
    `<span class="badge ${correct ? "right" : "wrong"}" id="verdict">${correct ? "correct" : "wrong"}</span> ` +
    `&middot; ${ex.tokens.length} tokens`;
  document.getElementById("text").textContent = ex.text;
  // Attention: from the lowest weight in view (white) to the highest (full orange).
  // Gradient x input: orange for the predicted label, blue against it, by |value| / max |value|.
  const weights = viewWeights(ex), gradient = state.shading === "gradient";
  const low = weights.length ? Math.min(...weights) : 0, high = weights.length ? Math.max(...weights) : 0;
  const largest = Math.max(Math.abs(low), Math.abs(high));
  const shade = w => gradient ? (largest > 0 ? Math.abs(w) / largest : 0)
                              : (high > low ? (w - low) / (high - low) : high > 0 ? 1 : 0);
  const colour = w => gradient && w < 0 ? "9, 105, 218" : "255, 140, 0";
  ex.tokens.forEach((token, i) => {
    const span = document.createElement("span");
    span.className = "tok" + (state.selected === i ? " selected" : "");
    span.textContent = token;
    span.dataset.index = i;
    span.dataset.weight = weights[i];
    span.title = `${token}: weight ${Number(weights[i]).toFixed(4)}`;
    span.dataset.shade = shade(weights[i]).toFixed(3);
    span.style.background = `rgba(${colour(weights[i])}, ${span.dataset.shade})`;
    span.addEventListener("click", () => select(i));
    tokens.appendChild(span); tokens.appendChild(document.createTextNode(" "));
  });
  const head = `head ${state.head}`;
  const deletion = document.getElementById("deletion");
  deletion.textContent = !ex.deletion ? "" : ex.deletion.k === 0 ? "No tokens to delete." :
    `Deleting the ${ex.deletion.k} most attended tokens moves P(positive) from ${ex.probability.toFixed(2)} ` +
    `to ${ex.deletion.without_top_attention.toFixed(2)} (${ex.deletion.k} random tokens: ${ex.deletion.without_random.toFixed(2)}).`;
  document.getElementById("hint").textContent = gradient
    ? `Gradient \u00d7 input: how much each token pushes the log-odds towards the predicted label ` +
      `(orange: towards it, blue: against it). Click a token to go back to attention and see its row.`
    : state.layer === "pooling"
    ? `Pooling, ${head}: the classifier's learned query attending over the review (what it looked at). Click a token for its self-attention row.`
    : state.selected === null
      ? `Block ${state.layer}, ${head}: the attention each token receives (mean over its column). Click a token for its row.`
      : `Block ${state.layer}, ${head}, the row of "${ex.tokens[state.selected]}": what it attends to. Click it again to go back.`;
  document.getElementById("legend").innerHTML = !weights.length ? "" : gradient
    ? `shading: <span class="swatch" style="background: rgba(9, 105, 218, 1)"></span> ${(-largest).toFixed(4)} ` +
      `to 0 to <span class="swatch" style="background: rgba(255, 140, 0, 1)"></span> ${largest.toFixed(4)}`
    : `shading: <span class="swatch" style="background: rgba(255, 140, 0, 0)"></span> ${low.toFixed(4)} ` +
      `to <span class="swatch" style="background: rgba(255, 140, 0, 1)"></span> ${high.toFixed(4)}`;
  drawHeatmap(ex);
  writeHash(index);
}
function writeHash(index) {
  // The view lives in the address (#review=3&layer=0&head=1&token=7): links and reloads keep it.
  const token = state.selected === null ? "" : `&token=${state.selected}`;
  const shading = state.shading === "gradient" ? "&shading=gradient" : "";
  try { history.replaceState(null, "", `#review=${index}&layer=${state.layer}&head=${state.head}${token}${shading}`); }
  catch (error) { /* some browsers refuse history on file:// pages; the view still works */ }
}
function readHash(hash) {
  const params = new URLSearchParams(hash.slice(1));
  const layer = params.get("layer"), head = Number(params.get("head"));
  if (layer !== null && (layer === "pooling" || Number(layer) < NUM_LAYERS)) {
    state.layer = layer === "pooling" ? "pooling" : Number(layer);
    document.getElementById("layer").value = layer;
  }
  if (Number.isInteger(head) && head >= 0 && head < NUM_HEADS) {
    state.head = head; document.getElementById("head").value = String(head);
  }
  if (HAS_GRADIENT && params.get("shading") === "gradient") {
    state.shading = "gradient"; document.getElementById("shading").value = "gradient";
  }
  const review = state.order.indexOf(Number(params.get("review")));
  if (params.has("review") && review >= 0) state.position = review;
  const token = Number(params.get("token"));
  if (params.has("token") && state.layer !== "pooling" && Number.isInteger(token) &&
      token >= 0 && token < EXAMPLES[state.order[state.position]].tokens.length) state.selected = token;
  render();
}
function drawHeatmap(ex) {
  // T x S: the block's (n, n) matrix, or the pooling query's (1, n) row.
  const canvas = document.getElementById("heatmap"), n = ex ? ex.tokens.length : 0;
  const pooling = state.layer === "pooling";
  const rows = !n ? new Float32Array(0) : pooling ? Float32Array.from(ex.pooling[state.head])
                                               : decodeRows(ex, state.layer, state.head);
  const height = pooling ? 1 : n;
  const cell = Math.max(1, Math.floor(300 / Math.max(1, n)));
  canvas.width = Math.max(1, cell * n);
  canvas.height = Math.max(1, pooling ? 24 : cell * n);
  const context = canvas.getContext("2d"), rowHeight = pooling ? 24 : cell;
  for (let i = 0; i < height; i++) {
    // Each row from its lowest weight (white) to its highest (dark), like the token shading.
    let low = Infinity, high = -Infinity;
    for (let j = 0; j < n; j++) { low = Math.min(low, rows[i * n + j]); high = Math.max(high, rows[i * n + j]); }
    for (let j = 0; j < n; j++) {
      const v = high > low ? (rows[i * n + j] - low) / (high - low) : 1;
      context.fillStyle = `rgb(${Math.round(255 - 80 * v)}, ${Math.round(255 - 140 * v)}, ${Math.round(255 - 255 * v)})`;
      context.fillRect(j * cell, i * rowHeight, cell, rowHeight);
    }
  }
  if (!pooling && state.selected !== null) {
    context.strokeStyle = "#d1242f"; context.strokeRect(0, state.selected * cell, n * cell, cell);
  }
  canvas.title = pooling ? `pooling, head ${state.head}: 1 x ${n}`
                         : `block ${state.layer}, head ${state.head}: ${n} x ${n} (row: attending token), each row from its lowest to its highest weight`;
}
function init() {
  const layer = document.getElementById("layer"), head = document.getElementById("head");
  layer.add(new Option("pooling", "pooling"));
  for (let l = 0; l < NUM_LAYERS; l++) layer.add(new Option(`block ${l}`, String(l)));
  for (let h = 0; h < NUM_HEADS; h++) head.add(new Option(`head ${h}`, String(h)));
  layer.addEventListener("change", () => {
    state.layer = layer.value === "pooling" ? "pooling" : Number(layer.value); state.selected = null; render();
  });
  head.addEventListener("change", () => { state.head = Number(head.value); render(); });
  const shading = document.getElementById("shading");
  document.getElementById("shading-control").hidden = !HAS_GRADIENT;
  shading.addEventListener("change", () => { state.shading = shading.value; render(); });
  document.getElementById("filter").addEventListener("change", applyFilter);
  document.getElementById("search").addEventListener("input", applyFilter);
  document.getElementById("prev").addEventListener("click", () => {
    if (state.position > 0) { state.position--; state.selected = null; render(); } });
  document.getElementById("next").addEventListener("click", () => {
    if (state.position < state.order.length - 1) { state.position++; state.selected = null; render(); } });
  document.addEventListener("keydown", e => {
    if (e.target.tagName === "INPUT") return;
    if (e.key === "ArrowLeft") document.getElementById("prev").click();
    if (e.key === "ArrowRight") document.getElementById("next").click();
  });
  const hash = location.hash;  // before the first render writes its own
  applyFilter();
  if (EXAMPLES.length) readHash(hash);
}
init();
</script>
</body>
</html>
"""


def records_from_saved_model(serve, texts, labels, indices=None, batch_size=8):
    """`apps.export.make_record` for each review, from a SavedModel's `serving_default`
    (`serve`), cut to each review's real tokens. `indices` as for `inspect_records`."""
    import tensorflow as tf

    from apps import export

    indices = list(range(len(texts)) if indices is None else indices)
    records = []
    for start in range(0, len(texts), batch_size):
        batch = list(texts[start : start + batch_size])
        out = serve(text=tf.constant(batch))
        for i, text in enumerate(batch):
            n = int(out["length"][i])
            records.append(
                export.make_record(
                    indices[start + i],
                    text,
                    [t.decode("utf-8") for t in out["tokens"][i, :n].numpy()],
                    labels[start + i],
                    float(out["probability"][i]),
                    out["pooling"][i, :, :n].numpy(),
                    out["attention"][i, :, :, :n, :n].numpy(),
                )  # fmt: skip
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

    from apps import data, export
    from apps.predict import resolve_model_path

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
    chosen = export.inspection_sample(len(splits.test_text), args.examples, seed)
    print(f"Serving {len(chosen)} {dataset} test reviews through {model_path}")
    serve = tf.saved_model.load(model_path).signatures["serving_default"]
    records = records_from_saved_model(
        serve, splits.test_text[chosen], splits.test_label[chosen], chosen
    )
    output = args.output or args.model
    os.makedirs(output, exist_ok=True)
    paths = [
        export.write_attention_jsonl(records, os.path.join(output, "attention.jsonl")),
        export.write_attention_html(
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
