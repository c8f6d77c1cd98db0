"""The attention viewer's page: one self-contained HTML file, no network.

`TEMPLATE` is the page; `apps.inspection.records.write_attention_html` replaces `__TITLE__` with the
title and `__DATA__` with the records as JSON. It lives here, below both `apps.serving.export`
(which fills it) and `apps.viewer` (the CLI), so the imports run one way.
"""

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
