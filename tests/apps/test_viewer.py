"""The attention viewer in a real browser: headless Chromium, driven by Selenium.

The page under test is the one the training app's export writes for a few real IMDB test
reviews, from a classifier with two blocks and two heads. Every check compares what the page
shows with the `attention.jsonl` written beside it. Chromium and its driver come from Debian's
`chromium` and `chromium-driver` packages, which `.ci/run` installs; without them these tests
fail with a message that says so (`apps.inspection.viewer.chromium`)."""

import json
import os
import re

import numpy as np
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from apps.classifier import data
from apps.classifier import model as model_lib
from apps.inspection import records as inspection_records
from apps.inspection import viewer

# Everything the page shows for the current review, read in one script call.
READ_TOKENS = """
return Array.from(document.querySelectorAll("#tokens .tok")).map(s => ({
  text: s.textContent, weight: Number(s.dataset.weight), shade: Number(s.dataset.shade),
  alpha: parseFloat(getComputedStyle(s).backgroundColor.split(",")[3] ?? "1"),
  blue: /^rgba?\(9, 105, 218[,)]/.test(getComputedStyle(s).backgroundColor),
  selected: s.classList.contains("selected")}));
"""


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """`attention.html` and `attention.jsonl` as a training run's report writes them, for 12
    real test reviews (`inspection_records.inspect_records` with the model: gradients and
    deletion tests).

    The classifier's weights are as initialized: the page shows whatever its records hold, and
    `tests/apps/test_app.py` checks the page a real run writes against its model."""
    texts, labels, _ = data.load_test_split("imdb_reviews")
    vectorizer = data.make_vectorizer(2000, 40)
    vectorizer.adapt(texts[:2000])
    model, inspector = model_lib.build_classifier(
        vocab_size=vectorizer.vocabulary_size(),
        sequence_length=40,
        embed_dim=16,
        num_heads=2,
        key_dim=8,
        ff_dim=32,
        num_layers=2,
        dropout=0.0,
        seed=0,
    )
    chosen = inspection_records.inspection_sample(len(texts), 12, seed=0)
    records = inspection_records.inspect_records(
        inspector, vectorizer, texts[chosen], labels[chosen], chosen, model=model
    )
    output = tmp_path_factory.mktemp("viewer")
    jsonl = inspection_records.write_attention_jsonl(records, str(output / "attention.jsonl"))
    html = inspection_records.write_attention_html(records, str(output / "attention.html"))
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    return output / os.path.basename(html), records


@pytest.fixture(scope="module")
def browser():
    driver = viewer.chromium(width=1200, height=900)
    yield driver
    driver.quit()


@pytest.fixture
def opened(page, browser):
    """The page freshly loaded: first review, pooling view, head 0."""
    html, records = page
    browser.set_window_size(1200, 900)
    browser.get(html.as_uri())
    return browser, records


def _tokens(browser):
    return browser.execute_script(READ_TOKENS)


def _select(browser, element_id, value):
    Select(browser.find_element(By.ID, element_id)).select_by_value(value)


def _expected_shade(weights):
    weights = np.asarray(weights, float)
    low, high = weights.min(), weights.max()
    return (weights - low) / (high - low) if high > low else np.ones_like(weights)


def test_every_example_and_token_is_there(opened):
    browser, records = opened
    assert browser.find_element(By.ID, "position").text == f"1 / {len(records)}"
    layers = Select(browser.find_element(By.ID, "layer")).options
    assert [o.get_attribute("value") for o in layers] == ["pooling", "0", "1"]
    assert len(Select(browser.find_element(By.ID, "head")).options) == 2
    for i, record in enumerate(records):
        shown = _tokens(browser)
        assert [t["text"] for t in shown] == record["tokens"], f"review {i}"
        assert "" not in [t["text"] for t in shown]  # no padding
        meta = browser.find_element(By.ID, "meta").text
        assert f"P(positive) = {record['probability']:.3f}" in meta
        assert ("correct" if record["label"] == record["prediction"] else "wrong") in meta
        assert ["negative", "positive"][record["label"]] in meta
        if i < len(records) - 1:
            browser.find_element(By.ID, "next").click()
    assert browser.find_element(By.ID, "position").text == f"{len(records)} / {len(records)}"
    assert not browser.find_element(By.ID, "next").is_enabled()
    browser.find_element(By.ID, "prev").click()
    assert browser.find_element(By.ID, "position").text.startswith(f"{len(records) - 1} /")


def test_head_switch_shades_with_that_heads_weights(opened):
    browser, records = opened
    record = records[0]
    shades = []
    for head in (0, 1):
        _select(browser, "head", str(head))
        shown = _tokens(browser)
        np.testing.assert_allclose([t["weight"] for t in shown], record["pooling"][head], atol=1e-6)
        want = _expected_shade(record["pooling"][head])
        np.testing.assert_allclose([t["shade"] for t in shown], want, atol=2e-3)
        # The browser keeps the colour's alpha in 8 bits: within 1/255 plus rounding.
        np.testing.assert_allclose([t["alpha"] for t in shown], want, atol=5e-3)
        shades.append([t["shade"] for t in shown])
    assert not np.allclose(shades[0], shades[1], atol=1e-2), "both heads shade alike"
    # A block's view: the attention each token receives, the column mean of that head.
    _select(browser, "layer", "1")
    _select(browser, "head", "1")
    received = np.asarray(record["attention"][1][1]).mean(axis=0)
    np.testing.assert_allclose([t["weight"] for t in _tokens(browser)], received, atol=1e-5)


def test_gradient_shading_and_the_deletion_line(opened):
    browser, records = opened
    for index, record in enumerate(records[:4]):
        if index:
            browser.find_element(By.ID, "next").click()
        deletion = record["deletion"]
        assert browser.find_element(By.ID, "deletion").text == (
            f"Deleting the {deletion['k']} most attended tokens moves P(positive) from "
            f"{record['probability']:.2f} to {deletion['without_top_attention']:.2f} "
            f"({deletion['k']} random tokens: {deletion['without_random']:.2f})."
        )
    browser.get(browser.current_url.split("#")[0])
    record = records[0]
    assert browser.find_element(By.ID, "shading-control").is_displayed()
    _select(browser, "shading", "gradient")
    shown = _tokens(browser)
    gradient = np.asarray(record["gradient_x_input"])
    np.testing.assert_allclose([t["weight"] for t in shown], gradient, atol=1e-7)
    # Orange towards the predicted label, blue against it, by |value| over the largest.
    want = np.abs(gradient) / np.abs(gradient).max()
    np.testing.assert_allclose([t["shade"] for t in shown], want, atol=2e-3)
    np.testing.assert_allclose([t["alpha"] for t in shown], want, atol=5e-3)
    # (A token whose shade rounds to alpha 0 has no colour to check.)
    coloured = [(t["blue"], bool(g < 0)) for t, g in zip(shown, gradient) if t["alpha"] > 0]
    assert coloured and all(blue == negative for blue, negative in coloured)
    assert any(negative for _, negative in coloured), "no token against the label to check"
    assert "shading=gradient" in browser.execute_script("return location.hash")
    # A click goes back to attention: the token's row.
    browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")[0].click()
    assert Select(browser.find_element(By.ID, "shading")).first_selected_option.text == "attention"
    assert not any(t["blue"] for t in _tokens(browser))


def test_no_gradient_no_shading_selector(tmp_path, browser):
    tokens = ["a", "fine", "film"]
    record = {
        "index": 0,
        "text": "a fine film",
        "tokens": tokens,
        "label": 1,
        "prediction": 1,
        "probability": 0.8,
        "pooling": [[0.2, 0.5, 0.3]],
        "attention": np.full((1, 1, 3, 3), 1 / 3).tolist(),
    }
    html = inspection_records.write_attention_html([record], str(tmp_path / "attention.html"))
    browser.get("file://" + os.path.abspath(html) + "#review=0&shading=gradient")
    assert not browser.find_element(By.ID, "shading-control").is_displayed()
    np.testing.assert_allclose([t["weight"] for t in _tokens(browser)], [0.2, 0.5, 0.3])
    assert browser.find_element(By.ID, "deletion").text == ""


def test_clicking_a_token_shows_its_row(opened):
    browser, records = opened
    record = records[0]
    _select(browser, "layer", "0")
    _select(browser, "head", "1")
    index = min(3, len(record["tokens"]) - 1)
    browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")[index].click()
    shown = _tokens(browser)
    row = np.asarray(record["attention"][0][1][index])
    # The page stores rows as bytes scaled to each row's maximum: within max/510.
    np.testing.assert_allclose([t["weight"] for t in shown], row, atol=row.max() / 510 + 1e-6)
    assert [t["selected"] for t in shown] == [i == index for i in range(len(shown))]
    hint = browser.find_element(By.ID, "hint").text
    assert f'the row of "{record["tokens"][index]}"' in hint
    # From the pooling view a click moves to the last block's row of that token.
    _select(browser, "layer", "pooling")
    browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")[index].click()
    assert Select(browser.find_element(By.ID, "layer")).first_selected_option.text == "block 1"
    row = np.asarray(record["attention"][1][1][index])
    np.testing.assert_allclose(
        [t["weight"] for t in _tokens(browser)], row, atol=row.max() / 510 + 1e-6
    )
    # The heatmap is the n x n matrix of the review.
    n = len(record["tokens"])
    width = browser.execute_script("return document.getElementById('heatmap').width")
    assert width == max(1, 300 // n) * n


def test_filters_and_search(opened, tmp_path):
    browser, records = opened
    wrong = [i for i, r in enumerate(records) if r["label"] != r["prediction"]]
    assert wrong and len(wrong) < len(records), "the run must give both verdicts to test"
    _select(browser, "filter", "wrong")
    position = browser.find_element(By.ID, "position")
    assert int(position.get_attribute("data-count")) == len(wrong)
    for _ in wrong:
        assert "wrong" in browser.find_element(By.ID, "verdict").text
        browser.find_element(By.ID, "next").click()
    _select(browser, "filter", "correct")
    assert int(position.get_attribute("data-count")) == len(records) - len(wrong)
    _select(browser, "filter", "confident")
    confident = max(records, key=lambda r: abs(r["probability"] - 0.5))
    assert [t["text"] for t in _tokens(browser)] == confident["tokens"]
    _select(browser, "filter", "all")
    word = records[-1]["tokens"][0]
    browser.find_element(By.ID, "search").send_keys(word)
    matches = [r for r in records if word in r["text"].lower()]
    assert int(position.get_attribute("data-count")) == len(matches) >= 1
    browser.find_element(By.ID, "search").send_keys("zzqxj-no-such-word")
    assert (
        position.text == "0 / 0" and "No review matches" in browser.find_element(By.ID, "meta").text
    )
    browser.find_element(By.ID, "search").clear()
    browser.find_element(By.ID, "search").send_keys(" ")  # an input event with an empty query
    assert position.text == f"1 / {len(records)}"
    path = tmp_path / "viewer.png"
    browser.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {path}")


def test_phone_width_and_a_512_token_review(tmp_path, browser):
    """A long review at 390 px: no sideways scrolling, every token shown, the heatmap fits."""
    rng = np.random.default_rng(0)
    n = 512
    attention = rng.random((1, 2, n, n))
    attention /= attention.sum(-1, keepdims=True)
    record = {
        "index": 0,
        "text": " ".join(f"word{i}" for i in range(n)),
        "tokens": [f"word{i}" for i in range(n)],
        "label": 1,
        "prediction": 0,
        "probability": 0.25,
        "pooling": np.full((2, n), 1 / n).tolist(),
        "attention": attention.round(5).tolist(),
    }
    html = inspection_records.write_attention_html([record], str(tmp_path / "attention.html"))
    browser.set_window_size(390, 844)
    browser.get("file://" + os.path.abspath(html))
    assert len(_tokens(browser)) == n
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    ), "the page scrolls sideways at phone width"
    heatmap = browser.find_element(By.ID, "heatmap")
    assert heatmap.rect["width"] <= 390
    assert browser.execute_script("return document.getElementById('heatmap').width") == n
    browser.save_screenshot(str(tmp_path / "phone.png"))


HOSTILE_REVIEWS = [
    "a review with <!--<script> in it",
    'an image <img src=x onerror="window.pwned=1"> that must stay text',
    "it ends </script><script>window.pwned=2</script> here & there",
]


def test_hostile_reviews_render_as_text(tmp_path, browser):
    """Reviews are user text: markup in them is shown, never parsed, and the page keeps working.

    Before the fix, `<!--<script>` left the whole page blank: the HTML parser stayed in
    the data block past its end tag and swallowed the page's own script.
    """
    records = []
    for index, text in enumerate(HOSTILE_REVIEWS):
        tokens = text.split()
        n = len(tokens)
        records.append(
            {
                "index": index,
                "text": text,
                "tokens": tokens,
                "label": 1,
                "prediction": 1,
                "probability": 0.75,
                "pooling": np.full((1, n), 1 / n).tolist(),
                "attention": np.full((1, 1, n, n), 1 / n).tolist(),
            }
        )
    html = inspection_records.write_attention_html(records, str(tmp_path / "attention.html"))
    browser.set_window_size(1200, 900)
    browser.get("file://" + os.path.abspath(html))
    for index, record in enumerate(records):
        if index:
            browser.find_element(By.ID, "next").click()
        shown = [token["text"] for token in _tokens(browser)]
        assert shown == record["tokens"], index
    assert browser.execute_script("return window.pwned === undefined"), "markup ran"
    assert not browser.find_elements(By.CSS_SELECTOR, "#tokens img")


def test_page_is_self_contained(page):
    html, _ = page
    text = html.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text
    assert "<script src" not in text and "<link" not in text


def test_the_address_keeps_the_view(page, browser):
    html, records = page
    record = records[1]
    browser.get(html.as_uri() + "#review=1&layer=1&head=0&token=2")
    assert browser.find_element(By.ID, "position").text == f"2 / {len(records)}"
    shown = _tokens(browser)
    assert [t["text"] for t in shown] == record["tokens"]
    row = np.asarray(record["attention"][1][0][2])
    np.testing.assert_allclose([t["weight"] for t in shown], row, atol=row.max() / 510 + 1e-6)
    _select(browser, "head", "1")
    browser.find_element(By.ID, "next").click()
    assert browser.execute_script("return location.hash") == "#review=2&layer=1&head=1"


def test_missing_chromium_names_what_to_install(monkeypatch):
    monkeypatch.delenv("CHROMIUM", raising=False)
    monkeypatch.delenv("CHROMEDRIVER", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match=r"found chromium=None.*apt-get install chromium"):
        viewer.chromium()


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["--examples", "0"], 2, "`--examples` must be positive. Received: examples=0"),
        (["--model", "no/such/run"], 2, "is not a SavedModel nor a run folder.*no/such/run"),
    ],
)
def test_viewer_cli_errors(argv, status, message, capsys):
    try:
        code = viewer.main(argv)
    except SystemExit as exit_info:  # argparse
        code = exit_info.code
    assert code == status
    assert re.search(message, capsys.readouterr().err)
