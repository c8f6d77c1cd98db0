"""The self-contained attention viewer page (`attention.html`); `__DATA__` is the embedded JSON."""

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
  #hint { font-size: 13px; color: #57606a; margin: 6px 0; }
  canvas { border: 1px solid #ddd; max-width: 100%; image-rendering: pixelated; background: #fff; }
  details { margin-top: 10px; font-size: 14px; }
  .text { white-space: pre-wrap; font-size: 13px; color: #57606a; }
</style>
</head>
<body>
<header>
  <h1>__TITLE__</h1>
  <p>Each token is shaded by the attention it receives. Click a token to see what it attends to
     (its row of the self-attention matrix). Padding is never shown.</p>
</header>
<div class="controls">
  <button id="prev" aria-label="previous">&larr; prev</button>
  <span id="position"></span>
  <button id="next" aria-label="next">next &rarr;</button>
  <label>show <select id="filter">
    <option value="all">all</option><option value="correct">correct</option>
    <option value="wrong">wrong</option><option value="confident">most confident</option>
    <option value="unsure">least confident</option></select></label>
  <label>search <input id="search" type="search" placeholder="words in the review"></label>
  <label>attention <select id="view"></select></label>
</div>
<main>
  <div class="meta" id="meta"></div>
  <div id="tokens"></div>
  <div id="hint"></div>
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
const state = { order: [], position: 0, view: "pooling:0", selected: null };

function decodeRows(b64, n) {
  const bytes = atob(b64); const out = new Float32Array(n * n);
  for (let i = 0; i < bytes.length; i++) out[i] = bytes.charCodeAt(i) / 255;
  return out;
}
function viewWeights(ex) {
  // The per-token shading of the current view: pooling, received, or a clicked token's row.
  const [kind, a, b] = state.view.split(":").map((v, i) => (i ? Number(v) : v));
  if (kind === "pooling") return ex.pooling[a];
  if (state.selected !== null) {
    const n = ex.tokens.length, rows = decodeRows(ex.rows[a][b], n);
    return Array.from(rows.slice(state.selected * n, state.selected * n + n));
  }
  return ex.received[a][b];
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
function render() {
  const position = document.getElementById("position");
  const tokens = document.getElementById("tokens");
  position.textContent = state.order.length ? `${state.position + 1} / ${state.order.length}` : "0 / 0";
  position.dataset.count = state.order.length;
  tokens.innerHTML = "";
  if (!state.order.length) { document.getElementById("meta").textContent = "No review matches."; return; }
  const index = state.order[state.position], ex = EXAMPLES[index];
  const label = ex.label ? "positive" : "negative", predicted = ex.prediction ? "positive" : "negative";
  const correct = ex.label === ex.prediction;
  document.getElementById("meta").innerHTML =
    `review #${index} &middot; label <span class="badge ${ex.label ? "pos" : "neg"}">${label}</span> ` +
    `predicted <span class="badge ${ex.prediction ? "pos" : "neg"}">${predicted}</span> ` +
    `P(positive) = ${ex.probability.toFixed(3)} ` +
    `<span class="badge ${correct ? "right" : "wrong"}" id="verdict">${correct ? "correct" : "wrong"}</span> ` +
    `&middot; ${ex.tokens.length} tokens`;
  document.getElementById("text").textContent = ex.text;
  const weights = viewWeights(ex);
  const top = Math.max(1e-9, ...weights);
  ex.tokens.forEach((token, i) => {
    const span = document.createElement("span");
    span.className = "tok" + (state.selected === i ? " selected" : "");
    span.textContent = token;
    span.dataset.index = i;
    span.dataset.weight = weights[i];
    span.title = `weight ${Number(weights[i]).toFixed(4)}`;
    span.style.background = `rgba(255, 140, 0, ${(weights[i] / top).toFixed(3)})`;
    span.addEventListener("click", () => {
      state.selected = state.selected === i ? null : i; render();
    });
    tokens.appendChild(span); tokens.appendChild(document.createTextNode(" "));
  });
  const kind = state.view.split(":")[0];
  document.getElementById("hint").textContent = kind === "pooling"
    ? "Pooling view: the classifier's learned query attending over the review."
    : state.selected === null
      ? "Self-attention view: shading is the attention each token receives (mean over rows). Click a token for its row."
      : `Row of "${ex.tokens[state.selected]}": what it attends to. Click it again to go back.`;
  drawHeatmap(ex);
}
function drawHeatmap(ex) {
  const canvas = document.getElementById("heatmap"), n = ex.tokens.length;
  const [kind, a, b] = state.view.split(":").map((v, i) => (i ? Number(v) : v));
  const layer = kind === "pooling" ? 0 : a, head = kind === "pooling" ? a : b;
  const rows = n ? decodeRows(ex.rows[layer][head], n) : new Float32Array(0);
  const cell = Math.max(1, Math.floor(300 / Math.max(1, n)));
  canvas.width = canvas.height = Math.max(1, cell * n);
  const context = canvas.getContext("2d");
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
    const v = rows[i * n + j];
    context.fillStyle = `rgb(${Math.round(255 - 80 * v)}, ${Math.round(255 - 140 * v)}, ${Math.round(255 - 255 * v)})`;
    context.fillRect(j * cell, i * cell, cell, cell);
  }
  if (state.selected !== null) {
    context.strokeStyle = "#d1242f"; context.strokeRect(0, state.selected * cell, n * cell, cell);
  }
  canvas.title = `block ${layer}, head ${head}: ${n} x ${n}, each row scaled to its maximum`;
}
function init() {
  const view = document.getElementById("view");
  for (let h = 0; h < NUM_HEADS; h++) view.add(new Option(`pooling, head ${h}`, `pooling:${h}`));
  for (let l = 0; l < NUM_LAYERS; l++) for (let h = 0; h < NUM_HEADS; h++)
    view.add(new Option(`block ${l}, head ${h}`, `block:${l}:${h}`));
  view.addEventListener("change", () => { state.view = view.value; render(); });
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
  applyFilter();
}
init();
</script>
</body>
</html>
"""
