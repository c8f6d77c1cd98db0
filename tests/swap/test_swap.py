"""`keras_sdpa.replace_attention` and `keras_sdpa.sdpa_scope` on Keras and keras-hub models.

Each model is built twice from one seed: as shipped, and swapped (after building, or built
inside the scope) with the stock model's weights. The swapped model must give the stock
model's outputs, with its weights in the same count, order and shapes. Nothing is downloaded:
keras-hub's models are built from small random configurations.
"""

import json

import keras
import numpy as np
import pytest
from keras_hub.src.layers.modeling import transformer_decoder, transformer_encoder
from keras_hub.src.layers.modeling.cached_multi_head_attention import CachedMultiHeadAttention
from keras_hub.src.models.bert.bert_backbone import BertBackbone
from keras_hub.src.models.clip.clip_text_encoder import CLIPTextEncoder
from keras_hub.src.models.gemma.gemma_backbone import GemmaBackbone
from keras_hub.src.models.gpt2.gpt2_backbone import GPT2Backbone
from keras_hub.src.models.gpt2.gpt2_causal_lm import GPT2CausalLM
from keras_hub.src.models.vit.vit_backbone import ViTBackbone
from keras_hub.src.models.whisper.whisper_backbone import WhisperBackbone

import keras_sdpa
from keras_sdpa import ScaledDotProductAttention

B, T, VOCAB = 2, 7, 53


def attention_kinds(model):
    """The class names of every attention-like layer inside `model`, depth first."""
    out = []

    def walk(layer):
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if "attention" in type(child).__name__.lower():
                out.append(type(child).__name__)
            walk(child)

    walk(model)
    return out


def same_weights(stock, swapped):
    want = [tuple(w.shape) for w in stock.weights]
    got = [tuple(w.shape) for w in swapped.weights]
    assert got == want
    for a, b in zip(stock.weights, swapped.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def replace(model, **options):
    """`keras_sdpa.replace_attention`, checking that every weight keeps its path. The layers
    it replaced then get other weights: a model that still called one of them would give
    other outputs than the stock model's (the twins start with equal weights)."""
    swappable = (
        keras.layers.MultiHeadAttention,
        keras.layers.GroupQueryAttention,
        CachedMultiHeadAttention,
    )
    replaced = [x for x in model._flatten_layers() if type(x) in swappable]
    paths = [w.path for w in model.weights]
    report = keras_sdpa.replace_attention(model, **options)
    assert [w.path for w in model.weights] == paths  # nothing keyed by path moves
    for layer in replaced:
        for variable in layer.weights:
            variable.assign(variable + 0.5)
    return report


def twins(build):
    """`build()` twice from one seed, the second with the first's weights."""
    keras.utils.set_random_seed(0)
    stock = build()
    keras.utils.set_random_seed(1)  # a different start: only the copied weights can agree
    other = build()
    other.set_weights(stock.get_weights())
    return stock, other


def token_inputs(padded):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (B, T)).astype("int32")
    mask = np.ones((B, T), bool)
    if padded:
        mask[0, 4:] = False
        ids[0, 4:] = 0
    return ids, mask


def bert():
    return BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
        dropout=0.0,
    )


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_bert_swapped_after_building_gives_the_same_outputs(padded):
    stock, ours = twins(bert)
    report = replace(ours)
    assert [name for _, name in report.swapped] == ["MultiHeadAttention"] * 2
    assert report.left == []
    assert attention_kinds(ours) == ["ScaledDotProductAttention"] * 2
    assert attention_kinds(stock) == ["MultiHeadAttention"] * 2
    assert all(
        type(block._self_attention_layer) is ScaledDotProductAttention
        for block in ours.transformer_layers
    )
    same_weights(stock, ours)
    ids, mask = token_inputs(padded)
    inputs = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    want, got = stock(inputs), ours(inputs)
    for key in ("sequence_output", "pooled_output"):
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=1e-5)


def test_bert_built_in_the_scope_has_this_layer_and_keras_names_come_back():
    before = keras.layers.MultiHeadAttention
    with keras_sdpa.sdpa_scope():
        keras.utils.set_random_seed(0)
        scoped = bert()
    assert keras.layers.MultiHeadAttention is before
    assert attention_kinds(scoped) == ["ScaledDotProductAttention"] * 2
    assert all(
        type(b._self_attention_layer) is ScaledDotProductAttention
        for b in scoped.transformer_layers
    )
    stock = bert()
    stock.set_weights(scoped.get_weights())
    ids, mask = token_inputs(padded=True)
    inputs = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    np.testing.assert_allclose(
        scoped(inputs)["sequence_output"], stock(inputs)["sequence_output"], atol=1e-5
    )


def test_the_scope_restores_every_name_on_an_error():
    names = (
        keras.layers.MultiHeadAttention,
        keras.layers.GroupQueryAttention,
        transformer_decoder.CachedMultiHeadAttention,
    )
    with pytest.raises(RuntimeError, match="inside"):
        with keras_sdpa.sdpa_scope(flash_attention=True):
            assert keras.layers.MultiHeadAttention is not names[0]
            assert transformer_decoder.CachedMultiHeadAttention is not names[2]
            layer = keras.layers.GroupQueryAttention(8, 4, 2)
            assert type(layer) is ScaledDotProductAttention
            assert (layer.num_heads, layer.key_dim, layer.num_key_value_heads) == (4, 8, 2)
            assert layer.flash_attention is True
            raise RuntimeError("inside")
    assert (
        keras.layers.MultiHeadAttention,
        keras.layers.GroupQueryAttention,
        transformer_decoder.CachedMultiHeadAttention,
    ) == names
    assert transformer_encoder.keras.layers.MultiHeadAttention is names[0]


def gpt2_lm():
    backbone = GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
        dropout=0.0,
    )
    lm = GPT2CausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def test_gpt2_swapped_after_building_generates_the_same_greedy_tokens():
    stock, ours = twins(gpt2_lm)
    report = replace(ours)
    assert [name for _, name in report.swapped] == ["CachedMultiHeadAttention"] * 2
    same_weights(stock, ours)
    ids, mask = token_inputs(padded=False)
    prompts = {
        "token_ids": np.pad(ids, [[0, 0], [0, 9]]),
        "padding_mask": np.pad(mask, [[0, 0], [0, 9]]),
    }
    prompts["padding_mask"][1, 3:] = False
    prompts["token_ids"][1, 3:] = 0
    want = stock.generate(prompts, stop_token_ids=None)["token_ids"]
    got = ours.generate(prompts, stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(got, want)
    logits = ours.backbone(prompts)
    np.testing.assert_allclose(logits, stock.backbone(prompts), atol=1e-5)


def test_vit_swapped_after_building_gives_the_same_outputs():
    def vit():
        return ViTBackbone(
            image_shape=(16, 16, 3),
            patch_size=4,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            mlp_dim=32,
        )

    stock, ours = twins(vit)
    report = replace(ours, flash_attention=True)
    assert [name for _, name in report.swapped] == ["MultiHeadAttention"] * 2
    assert all(layer.flash_attention is True for layer in _sdpa_layers(ours))
    same_weights(stock, ours)
    images = np.random.default_rng(0).random((B, 16, 16, 3)).astype("float32")
    np.testing.assert_allclose(ours(images), stock(images), atol=1e-5, rtol=1e-5)


def test_clip_text_encoder_swapped_after_building_gives_the_same_outputs():
    def clip():
        return CLIPTextEncoder(
            vocabulary_size=VOCAB,
            embedding_dim=16,
            hidden_dim=16,
            num_layers=2,
            num_heads=2,
            intermediate_dim=32,
            max_sequence_length=T,
        )

    stock, ours = twins(clip)
    report = replace(ours)
    assert [name for _, name in report.swapped] == ["MultiHeadAttention"] * 2
    same_weights(stock, ours)
    ids, _ = token_inputs(padded=True)
    want, got = stock({"token_ids": ids}), ours({"token_ids": ids})
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_weights_file_of_the_stock_model_loads_into_the_swapped_one(tmp_path):
    keras.utils.set_random_seed(0)
    stock = bert()
    path = str(tmp_path / "stock.weights.h5")
    stock.save_weights(path)
    keras.utils.set_random_seed(1)
    ours = bert()
    replace(ours)
    ours.load_weights(path)  # as `from_preset` loads a preset's weights
    ids, mask = token_inputs(padded=True)
    inputs = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    np.testing.assert_allclose(
        ours(inputs)["sequence_output"], stock(inputs)["sequence_output"], atol=1e-5
    )


def _sdpa_layers(model):
    return [x for x in model._flatten_layers() if isinstance(x, ScaledDotProductAttention)]


def test_whisper_and_gemma_keep_their_classes_with_the_kernel_swapped():
    whisper = WhisperBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        num_mels=8,
        max_encoder_sequence_length=16,
        max_decoder_sequence_length=8,
    )
    report = keras_sdpa.replace_attention(whisper)
    # The encoder's self-attention, the decoder's self- and cross-attention.
    assert [name for _, name in report.kernels] == ["WhisperCachedMultiHeadAttention"] * 3
    assert report.left == [] and report.swapped == [], report
    gemma = GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
    )
    report = keras_sdpa.replace_attention(gemma)
    assert [name for _, name in report.kernels] == ["CachedGemmaAttention"], report
    assert report.left == [] and report.swapped == []
    assert "Kernel swapped in 1 layer(s)" in str(report) and "CachedGemmaAttention" in str(report)
    ids, mask = token_inputs(padded=True)
    out = gemma({"token_ids": ids, "padding_mask": mask})  # its own class, and still runs
    assert out.shape == (B, T, 16) and np.isfinite(keras.ops.convert_to_numpy(out)).all()


def functional(layer, value_width):
    query = keras.Input((T, 12))
    value = keras.Input((5, value_width))
    out = layer(query, value, use_causal_mask=False)
    return keras.Model([query, value], keras.layers.Dense(3)(out))


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, value_dim=3),
        lambda: keras.layers.GroupQueryAttention(
            head_dim=4, num_query_heads=4, num_key_value_heads=2
        ),
    ],
    ids=["mha", "gqa"],
)
def test_a_functional_graph_node_is_swapped_and_saves_as_this_layer(make, tmp_path, request):
    gqa = "gqa" in request.node.callspec.id
    stock, ours = twins(lambda: functional(make(), value_width=12 if gqa else 10))
    report = replace(ours)
    assert len(report.swapped) == 1
    same_weights(stock, ours)
    rng = np.random.default_rng(0)
    inputs = [
        rng.random((B, T, 12)).astype("float32"),
        rng.random((B, 5, 12 if gqa else 10)).astype("float32"),
    ]
    want = stock.predict(inputs, verbose=0)
    np.testing.assert_allclose(ours.predict(inputs, verbose=0), want, atol=1e-5)
    path = str(tmp_path / "swapped.keras")
    ours.save(path)
    loaded = keras.saving.load_model(path)
    assert attention_kinds(loaded) == ["ScaledDotProductAttention"]
    np.testing.assert_allclose(loaded.predict(inputs, verbose=0), want, atol=1e-5)


class Holder(keras.layers.Layer):
    """Attention held in an attribute, in a list and in a dict; the same layer twice."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="first")
        self.stack = [keras.layers.MultiHeadAttention(num_heads=1, key_dim=8, name="listed")]
        self.by_name = {"cached": CachedMultiHeadAttention(num_heads=2, key_dim=3, name="kept")}

    def call(self, x):
        x = x + self.first(x, x)
        x = x + self.stack[0](x, x)
        x = x + self.by_name["cached"](x, x)
        return x + self.first(x, x)


def test_attributes_lists_and_dicts_are_swapped_and_the_weights_keep_their_order():
    def build():
        holder = Holder()
        holder(np.zeros((1, T, 8), "float32"))
        return holder

    stock, ours = twins(build)
    before = [id(w) for w in ours.weights]
    report = replace(ours, implementation="dense")
    assert sorted(path.split("/")[-1] for path, _ in report.swapped) == ["first", "kept", "listed"]
    assert type(ours.first) is type(ours.stack[0]) is ScaledDotProductAttention
    assert type(ours.by_name["cached"]) is ScaledDotProductAttention
    assert [id(w) for w in ours.weights] != before  # new variables, same values
    same_weights(stock, ours)
    x = np.random.default_rng(0).random((B, T, 8)).astype("float32")
    np.testing.assert_allclose(ours(x), stock(x), atol=1e-5)


def test_a_model_fits_after_the_swap():
    keras.utils.set_random_seed(0)
    backbone = bert()
    replace(backbone)
    ids, mask = token_inputs(padded=True)
    inputs = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    pooled = backbone(inputs)["pooled_output"]
    head = keras.layers.Dense(1)
    model = keras.Model(backbone.input, head(backbone.output["pooled_output"]))
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    before = [keras.ops.convert_to_numpy(w).copy() for w in backbone.weights]
    history = model.fit(inputs, np.array([0.0, 1.0]), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    moved = [
        not np.allclose(a, keras.ops.convert_to_numpy(w)) for a, w in zip(before, backbone.weights)
    ]
    assert sum(moved) > len(moved) // 2
    assert pooled.shape == (B, 16)


def test_a_tf_checkpoint_saves_and_restores_the_new_layers(tmp_path):
    """The swapped layer is the parent's checkpoint dependency, not the layer it replaced."""
    first, second = twins(bert)
    for model in (first, second):
        replace(model)
    import tensorflow as tf  # TensorFlow's own checkpoints: this test runs on TensorFlow only

    path = tf.train.Checkpoint(model=first).write(str(tmp_path / "ckpt"))
    for variable in second.weights:
        variable.assign(variable + 1.0)
    tf.train.Checkpoint(model=second).read(path).assert_consumed()
    ids, mask = token_inputs(padded=True)
    inputs = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    np.testing.assert_allclose(
        second(inputs)["sequence_output"], first(inputs)["sequence_output"], atol=1e-6
    )


def test_a_shared_attention_whose_output_is_the_models_saves_and_loads(tmp_path):
    def build():
        x = keras.Input((T, 12))
        attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        first = attention(x, x)
        return keras.Model(x, [attention(first, x), first])  # called twice; outputs are its

    stock, ours = twins(build)
    assert len(replace(ours).swapped) == 1
    x = np.random.default_rng(0).random((B, T, 12)).astype("float32")
    want = stock(x)
    path = str(tmp_path / "shared.keras")
    ours.save(path)
    loaded = keras.saving.load_model(path)
    assert attention_kinds(loaded) == ["ScaledDotProductAttention"]
    for model in (ours, loaded):
        for got, expected in zip(model(x), want):
            np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_scope_leaves_subclasses_and_late_imports_as_outside_it():
    import sys
    import types

    module = types.ModuleType("keras_user_module")
    with keras_sdpa.sdpa_scope():

        class Mine(keras.layers.MultiHeadAttention):  # defined in the scope
            pass

        sys.modules[module.__name__] = module  # a module imported in the scope
        module.MultiHeadAttention = keras.layers.MultiHeadAttention
    try:
        assert module.MultiHeadAttention is keras.layers.MultiHeadAttention
        assert Mine.__mro__[1] is keras.layers.MultiHeadAttention
        assert type(Mine(num_heads=2, key_dim=4)) is Mine
    finally:
        del sys.modules[module.__name__]


def test_a_cached_attention_with_a_gate_is_left_and_says_why():
    holder = keras.layers.Layer()
    holder.gated = CachedMultiHeadAttention(num_heads=2, key_dim=4, use_gate=True)
    report = keras_sdpa.replace_attention(holder)
    assert report.swapped == [] and "ignores its `use_gate`" in report.left[0][2]


def test_bad_arguments_name_what_was_received():
    with pytest.raises(ValueError, match="must hold the attention layers.*MultiHeadAttention"):
        keras_sdpa.replace_attention(keras.layers.MultiHeadAttention(num_heads=2, key_dim=4))
    with pytest.raises(ValueError, match="`model` must be a Keras layer.*Received: model='x'"):
        keras_sdpa.replace_attention("x")
    with pytest.raises(ValueError, match="flash_attention='yes'"):
        keras_sdpa.replace_attention(bert(), flash_attention="yes")
    with pytest.raises(ValueError, match=r"Unknown .*\['key_size'\]"):
        keras_sdpa.replace_attention(bert(), key_size=4)
    with pytest.raises(ValueError, match=r"Unknown .*\['heads'\]"):
        with keras_sdpa.sdpa_scope(heads=2):
            pass


def numpy_sized_gqa():
    """A functional model whose GroupQueryAttention has NumPy sizes (`hidden // heads`)."""
    return functional(
        keras.layers.GroupQueryAttention(
            head_dim=np.int64(4), num_query_heads=np.int64(4), num_key_value_heads=np.int64(2)
        ),
        value_width=12,
    )


def test_numpy_sizes_swap_and_build_in_the_scope_as_keras_takes_them():
    """Keras's layers take NumPy integers as sizes; so do the swap and the scope, and the new
    layer keeps Python ints, so that its config stays JSON."""
    stock, ours = twins(numpy_sized_gqa)
    assert len(replace(ours).swapped) == 1
    with keras_sdpa.sdpa_scope():
        keras.utils.set_random_seed(1)
        scoped = numpy_sized_gqa()
    scoped.set_weights(stock.get_weights())
    rng = np.random.default_rng(0)
    inputs = [rng.random((B, T, 12)).astype("float32"), rng.random((B, 5, 12)).astype("float32")]
    want = stock.predict(inputs, verbose=0)
    for model in (ours, scoped):
        assert attention_kinds(model) == ["ScaledDotProductAttention"]
        np.testing.assert_allclose(model.predict(inputs, verbose=0), want, atol=1e-5)
        (layer,) = [x for x in model._flatten_layers() if isinstance(x, ScaledDotProductAttention)]
        assert type(layer.num_heads) is int and type(layer.key_dim) is int
        json.dumps(layer.get_config())
