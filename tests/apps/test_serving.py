"""The shipped SavedModel as a service sees it: its two signatures, length buckets that change
no result, `saved_model_cli`, `keras.layers.TFSMLayer`, and `apps.predict` at volume.

Every check that loads the SavedModel runs in a process that never imports `keras_sdpa`.
"""

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from apps.classifier import buckets, data
from apps.serving import export, predict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAVED_MODEL = os.path.join(ROOT, "saved_models", "imdb_sdpa", "saved_model")
SERVING_OUTPUTS = {"probability": "float32", "label": "int32", "length": "int32"}
INSPECT_OUTPUTS = {
    **SERVING_OUTPUTS,
    "tokens": "string",
    "attention": "float32",
    "pooling": "float32",
}


def _python(script, stdin=None, timeout=600):
    """Runs `script` in a fresh interpreter; fails if it imported keras_sdpa or the apps."""
    check = "\nimport sys\nassert 'keras_sdpa' not in sys.modules and 'apps' not in sys.modules\n"
    result = subprocess.run(
        [sys.executable, "-c", script + check],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return result.stdout.decode()


def _without_session_xla_cache():
    """The environment without the test session's own XLA cache (tests/conftest.py), which
    `apps.predict` would keep instead of its `--xla_cache`."""
    env = dict(os.environ)
    env.pop("TF_XLA_FLAGS", None)
    return env


@functools.lru_cache
def reviews_by_bucket(run):
    """Real test reviews: for every length bucket of the run folder `run`'s SavedModel,
    reviews whose tokens fall in it."""
    texts, _, _ = data.load_test_split("imdb_reviews")
    with open(os.path.join(run, "metrics.json")) as f:
        config = json.load(f)["config"]  # the run's own, whatever its configuration
    length = config["sequence_length"]
    vectorizer = data.make_vectorizer(
        config["vocab_size"], length, vocabulary=os.path.join(run, "vocabulary.txt")
    )
    lengths = (data.vectorize(vectorizer, texts[:3000]) != 0).sum(axis=1)
    sizes = export.bucket_sizes(length)
    bounds = (0,) + sizes
    chosen = []
    for low, high in zip(bounds[:-1], bounds[1:]):
        inside = np.flatnonzero((lengths > low) & (lengths <= high))
        assert len(inside) >= 3, (low, high)
        chosen.extend(inside[:12].tolist())
    return [texts[i] for i in chosen], lengths[chosen]


def test_both_signatures_and_their_outputs():
    script = f"""
import json
import tensorflow as tf
loaded = tf.saved_model.load({SAVED_MODEL!r})
out = {{}}
for name, function in loaded.signatures.items():
    spec = function.structured_input_signature[1]
    out[name] = {{
        "inputs": {{k: [v.dtype.name, v.shape.as_list()] for k, v in spec.items()}},
        "outputs": {{k: [v.dtype.name, v.shape.as_list()]
                    for k, v in function.structured_outputs.items()}},
    }}
print(json.dumps(out))
"""
    signatures = json.loads(_python(script).splitlines()[-1])
    assert set(signatures) == {"serving_default", "inspect"}
    for name, outputs in (("serving_default", SERVING_OUTPUTS), ("inspect", INSPECT_OUTPUTS)):
        assert signatures[name]["inputs"] == {"text": ["string", [None]]}
        assert {k: v[0] for k, v in signatures[name]["outputs"].items()} == outputs, name
    # No per-token matrix in the default answer: one number per review each.
    assert all(shape == [None] for _, shape in signatures["serving_default"]["outputs"].values())


@pytest.mark.large  # saved_model_cli on the shipped model
def test_saved_model_cli_lists_both_signatures():
    cli = shutil.which("saved_model_cli") or os.path.join(
        os.path.dirname(sys.executable), "saved_model_cli"
    )
    result = subprocess.run(
        [cli, "show", "--dir", SAVED_MODEL, "--all"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    listing = result.stdout
    blocks = re.split(r"signature_def\['", listing)[1:]
    found = {block.split("'")[0]: block for block in blocks}
    assert "serving_default" in found and "inspect" in found
    for name, outputs in (("serving_default", SERVING_OUTPUTS), ("inspect", INSPECT_OUTPUTS)):
        block = found[name].split("Method name is")[0]
        assert "inputs['text'] tensor_info:" in block and "dtype: DT_STRING" in block
        listed = set(re.findall(r"outputs\['(\w+)'\]", block))
        assert listed == set(outputs), (name, listed)


@pytest.fixture(scope="module")
def fresh_export(tmp_path_factory):
    """The shipped run exported again by this code (the committed one is an artifact)."""
    from apps.classifier import run_folder

    run = run_folder.load_run(os.path.dirname(SAVED_MODEL))
    path = str(tmp_path_factory.mktemp("export") / "saved_model")
    return export.export_saved_model(run.model, run.inspector, run.vectorizer, path)


def _saved_model(which, request):
    """The session's tiny run's SavedModel (this code's export, in the default tier), the
    committed one, or the shipped run exported again by this code."""
    if which == "tiny":
        return os.path.join(request.getfixturevalue("tiny_run")[0], "saved_model")
    return SAVED_MODEL if which == "committed" else request.getfixturevalue("fresh_export")


@pytest.mark.default_cases("tiny")  # the shipped model's buckets up to 512: large
@pytest.mark.xdist_group("test_serving")  # "fresh" reaches `fresh_export` by getfixturevalue
@pytest.mark.parametrize("which", ["tiny", "committed", "fresh"])
def test_length_buckets_give_the_full_length_result(which, request):
    """`serving_default` computes each review at its bucket's length; `inspect` at the
    sequence length. On real reviews of every bucket, mixed in one batch or one a call, they
    agree to 1e-6."""
    saved_model = _saved_model(which, request)
    # The run folder its vocabulary and configuration come from (the shipped one for "fresh").
    run = os.path.dirname(saved_model if which == "tiny" else SAVED_MODEL)
    texts, lengths = reviews_by_bucket(run)
    order = np.random.default_rng(0).permutation(len(texts))  # buckets interleaved
    script = f"""
import json, sys
import tensorflow as tf
loaded = tf.saved_model.load({saved_model!r})
texts = [line.rstrip(b"\\n") for line in sys.stdin.buffer]
served = loaded.signatures["serving_default"](text=tf.constant(texts))
inspected = loaded.signatures["inspect"](text=tf.constant(texts))
alone = [loaded.signatures["serving_default"](text=tf.constant([t])) for t in texts]
print(json.dumps({{
    "served": served["probability"].numpy().tolist(),
    "alone": [float(a["probability"][0]) for a in alone],
    "alone_length": [int(a["length"][0]) for a in alone],
    "inspected": inspected["probability"].numpy().tolist(),
    "length": served["length"].numpy().tolist(),
    "labels_equal": bool((served["label"].numpy() == inspected["label"].numpy()).all()),
}}))
"""
    stdin = b"".join(texts[i].replace(b"\n", b" ") + b"\n" for i in order)
    out = json.loads(_python(script, stdin=stdin).splitlines()[-1])
    np.testing.assert_array_equal(out["length"], lengths[order])
    np.testing.assert_allclose(out["served"], out["inspected"], atol=1e-6, rtol=0)
    # One review a call skips the grouping (`classify_by_length`): the same answer.
    np.testing.assert_array_equal(out["alone_length"], lengths[order])
    np.testing.assert_allclose(out["alone"], out["inspected"], atol=1e-6, rtol=0)
    assert out["labels_equal"]


@pytest.mark.default_cases("tiny", "committed")
@pytest.mark.xdist_group("test_serving")  # "fresh" reaches `fresh_export` by getfixturevalue
@pytest.mark.parametrize("which", ["tiny", "committed", "fresh"])
def test_saved_model_holds_each_graph_once(which, request):
    """Each signature's graph is stored once, and the custom gradients' functions not at all
    (serving never differentiates): a second copy of every graph doubled the load time."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved_model = _saved_model(which, request)
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(saved_model, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    names = [f.signature.name for f in proto.meta_graphs[0].graph_def.library.function]
    for endpoint in ("serve", "inspect"):
        traces = [n for n in names if re.fullmatch(rf"__inference_{endpoint}_\d+", n)]
        assert len(traces) == 1, traces
    assert not [n for n in names if "grad_fn" in n]


@pytest.mark.large  # a process of its own, on the shipped model
def test_tfsm_layer_serves_inside_a_keras_model():
    texts = [b"A wonderful, moving film.", b"Dull and far too long.", b""]
    script = f"""
import json
import keras
import tensorflow as tf
layer = keras.layers.TFSMLayer({SAVED_MODEL!r}, call_endpoint="serving_default")
text = keras.Input(shape=(), dtype="string")
outputs = layer(text)
model = keras.Model(text, outputs["probability"])
got = model(tf.constant({texts!r})).numpy().tolist()
direct = tf.saved_model.load({SAVED_MODEL!r}).signatures["serving_default"]
want = direct(text=tf.constant({texts!r}))["probability"].numpy().tolist()
print(json.dumps([got, want]))
"""
    got, want = json.loads(_python(script).splitlines()[-1])
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert got[0] > 0.5 > got[1]


def test_count_tokens_is_the_vectorizers_count():
    """`apps.predict` groups reviews by `buckets.count_tokens` without TensorFlow: it must
    count what the app's vectorizer reads, on real reviews and on awkward text."""
    texts, _, _ = data.load_test_split("imdb_reviews")
    awkward = [
        b"",
        b"'' ' '''",
        b"don't 'quoted' words'' ''edge",
        b"snake_case and-dashes--here",
        b"line<br />break<BR>again<br/>x",
        "café naïve — dash".encode(),
        b"\xff\xfe bad bytes \xc3",
        "12,000 1/2 ½ 3.14".encode(),
        "emoji 😀ok".encode(),
    ]
    sample = list(texts[:3000]) + awkward
    vectorizer = data.make_vectorizer(10000, 4096)  # every word, known or not
    vectorizer.adapt(tf.constant([b"a b"]))
    expected = (data.vectorize(vectorizer, sample) != 0).sum(axis=1)
    assert expected.max() < 4096  # nothing was cut
    got = np.array([buckets.count_tokens(t) for t in sample])
    mismatched = np.flatnonzero(got != expected)
    assert not len(mismatched), [(sample[i][:80], got[i], expected[i]) for i in mismatched[:5]]


def test_predict_batches_one_bucket_each_and_fills_the_last():
    texts, _, _ = data.load_test_split("imdb_reviews")
    texts = list(texts[:1000])
    bucket = [buckets.bucket_of(buckets.count_tokens(t)) for t in texts]
    for fill in (False, True):
        plan = predict.batches(texts, 64, fill=fill)
        seen = [i for chosen in plan for i in dict.fromkeys(chosen)]
        assert sorted(seen) == list(range(len(texts)))  # each review once
        for chosen in plan:
            assert len({bucket[i] for i in chosen}) == 1
            assert len(chosen) == 64 if fill else 1 <= len(chosen) <= 64
    # Every bucket's batches are full but its last; filling repeats that one's last review.
    assert len(plan) == sum(-(-bucket.count(b) // 64) for b in set(bucket))
    short = [chosen for chosen in plan if len(set(chosen)) < 64]
    assert short and all(chosen[-1] == chosen[len(set(chosen)) - 1] for chosen in short)
    # Each bucket's first batch comes right after the previous bucket's first, before the
    # rest of that one's: its program compiles while the other workers compute.
    order = [bucket[chosen[0]] for chosen in plan]
    kinds = sorted(set(bucket))
    firsts = [order.index(b) for b in kinds]
    assert firsts[:2] == [0, 1]
    for previous, b in zip(kinds, kinds[1:]):
        rest = [i for i, o in enumerate(order) if o == previous][1:]
        assert not rest or order.index(b) < rest[0], (previous, b, order)
    # Counts given are the ones used.
    counts = [0] * len(texts)  # every review in the first bucket
    plan = predict.batches(texts, 64, counts=counts)
    assert len(plan) == -(-len(texts) // 64)  # one bucket: full batches
    assert sorted(i for chosen in plan for i in chosen) == list(range(len(texts)))


def test_predict_counts_words_in_a_forked_process_before_tensorflow():
    """`apps.predict` counts the first chunk's words on another core while TensorFlow loads:
    the same counts as in-process, and never forked once TensorFlow is imported."""
    script = (
        "import sys\n"
        "from apps.serving import predict\n"
        "texts = [line.encode() * (i % 7) for i, line in enumerate(sys.argv[1:])]\n"
        "future = predict._count_aside(texts)\n"
        "assert future is not None, 'no process forked'\n"
        "counts = predict._counted(future)\n"
        "assert counts == predict.count_words(texts), counts\n"
        "import tensorflow\n"
        "assert predict._count_aside(texts) is None\n"
    )
    words = ["a b", "it's fine", "<br />x", "", "''", "naïve café 42"]
    result = subprocess.run(
        [sys.executable, "-c", script, *words], capture_output=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]


@pytest.mark.parametrize("flag", ["--rounds", "--latency_block"])
def test_serving_benchmark_rejects_a_count_below_one(flag):
    """`benchmarks/serving.py` names the argument and the value it refuses, before it loads
    anything."""
    result = subprocess.run(
        [sys.executable, "benchmarks/serving.py", flag, "0"],
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert f"{flag} must be at least 1. Received: 0" in result.stderr.decode()


@pytest.mark.large  # a predictor process per case (test_app's CLI tests keep one by default)
@pytest.mark.parametrize(
    "which, count, batch_size", [("tiny", 240, 32), ("committed", 700, 64)], ids=["tiny", "shipped"]
)
def test_predict_reads_a_file_and_answers_in_input_order(
    which, count, batch_size, tmp_path, request
):
    """`apps.predict --input` groups reviews by length, yet writes them in input order, each
    with the probability the SavedModel gives it alone."""
    saved_model = _saved_model(which, request)
    texts, _, _ = data.load_test_split("imdb_reviews")
    chosen = [t.replace(b"\n", b" ") for t in texts[:count]]
    chosen[5] = b""
    chosen[9] = b"<!--<script> \xff\xfe"
    path = tmp_path / "reviews.txt"
    path.write_bytes(b"\n".join(chosen) + b"\n")
    script = (
        "import sys; sys.argv = ['predict'] + sys.argv[1:]\n"
        "from apps import predict\n"
        "code = predict.main(sys.argv[1:])\n"
        "assert 'keras_sdpa' not in sys.modules\n"
        "sys.exit(code)\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "--model",
            saved_model,
            "--input",
            str(path),
            "--json",
            "--batch_size",
            str(batch_size),
            "--xla_cache",
            str(tmp_path / "xla"),
        ],
        capture_output=True,
        timeout=900,
        cwd=ROOT,
        env=_without_session_xla_cache(),
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    answers = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert len(answers) == len(chosen)
    assert [a["text"] for a in answers] == [t.decode("utf-8", "replace") for t in chosen]
    assert answers[5]["tokens"] == 0 and "note" in answers[5]
    loaded = tf.saved_model.load(saved_model)
    serve = loaded.signatures["serving_default"]
    sample = list(range(0, len(chosen), 13))
    alone = [float(serve(text=tf.constant([chosen[i]]))["probability"][0]) for i in sample]
    np.testing.assert_allclose([answers[i]["probability"] for i in sample], alone, atol=1e-6)
    progress = result.stderr.decode().replace("\r", "\n")
    assert f"{len(chosen)}/{len(chosen)} reviews" in progress  # the bar on stderr
    counts = {int(n) for n in re.findall(rf"(\d+)/{len(chosen)} reviews", progress)}
    assert len(counts) >= 5, counts  # it moves batch by batch, not once at the end
    assert os.listdir(tmp_path / "xla")  # the compiled programs were kept
