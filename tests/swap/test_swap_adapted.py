"""`replace_attention` on models whose attention projections are LoRA-enabled or int8-quantized.

keras-hub's users fine-tune with `backbone.enable_lora(rank)` and serve with
`model.quantize("int8")`, both before any swap. The swap keeps those projections (the low-rank
factors; the int8 kernel and its scale) as they are, and the model computes what it computed:
the stock model, adapted the same way, is the reference.
"""

import gc
from unittest import mock

import keras
import numpy as np
import pytest
from keras_hub.src.models.bert.bert_backbone import BertBackbone
from keras_hub.src.models.gpt2.gpt2_backbone import GPT2Backbone
from keras_hub.src.models.llama.llama_backbone import LlamaBackbone
from on_backend import numpy

import keras_sdpa
from keras_sdpa import ScaledDotProductAttention
from keras_sdpa._swap import families

B, T, VOCAB = 2, 7, 53
TEXT = dict(
    num_layers=2,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    vocabulary_size=VOCAB,
    dropout=0.0,
    max_sequence_length=16,
)
DECODER = dict(
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    vocabulary_size=VOCAB,
)
BACKBONES = {
    "bert": lambda: BertBackbone(**TEXT),
    "gpt2": lambda: GPT2Backbone(**TEXT),
    "llama": lambda: LlamaBackbone(**DECODER),  # its own attention class: a kernel swap
}


def inputs(backbone):
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, VOCAB, (B, T)).astype("int32")}
    x["padding_mask"] = np.ones((B, T), bool)
    x["padding_mask"][0, -3:] = False
    if "segment_ids" in {spec.name for spec in backbone.inputs}:
        x["segment_ids"] = np.zeros((B, T), "int32")
    return x


def sequence(out):
    """The `(B, T, hidden)` output: BERT's under its name, GPT-2's as it is."""
    return out["sequence_output"] if isinstance(out, dict) else out


def adapted(name, mode, swap_first=False):
    """A tiny backbone with LoRA (its factors made non-zero, so that they count) or int8;
    with `swap_first`, its attention swapped before it is adapted."""
    keras.utils.set_random_seed(0)
    backbone = BACKBONES[name]()
    if swap_first:
        keras_sdpa.replace_attention(backbone)
    if mode == "lora":
        backbone.enable_lora(4)
        rng = np.random.default_rng(1)
        for variable in backbone.trainable_weights:  # lora_kernel_b starts at zero
            variable.assign(rng.normal(size=variable.shape).astype("float32") * 0.3)
    else:
        # Keras runs a full `gc.collect()` for each float kernel it deletes (to free device
        # memory sooner): 15 in a tiny BERT, each walking every object the session holds
        # (18 s for this test's two models late in the JAX session, against 0.1 s without).
        with mock.patch.object(gc, "collect"):
            backbone.quantize("int8")
    return backbone


def attention_layers(backbone):
    """The swapped layers and the kernel-swapped family layers of `backbone`."""
    return [
        layer
        for layer in backbone._flatten_layers()
        if isinstance(layer, ScaledDotProductAttention) or families.is_swapped(layer)
    ]


def projections(layer):
    """The query and value projections of a swapped layer or of a family's attention."""
    if isinstance(layer, ScaledDotProductAttention):
        return layer.query_dense, layer.value_dense
    return layer._query_dense, layer._value_dense


@pytest.mark.filterwarnings("ignore::UserWarning")  # layers that have no `quantize`
@pytest.mark.default_cases("bert-lora", "llama-lora", "llama-int8")
@pytest.mark.parametrize("mode", ["lora", "int8"])
@pytest.mark.parametrize("name", list(BACKBONES))
def test_an_adapted_model_is_swapped_and_computes_what_it_did(name, mode):
    backbone = adapted(name, mode)
    x = inputs(backbone)
    want = numpy(sequence(backbone(x)))
    paths = [(w.path, w.trainable, str(w.dtype)) for w in backbone.weights]
    report = keras_sdpa.replace_attention(backbone)
    swaps = len(report.swapped) + len(report.kernels)
    assert swaps == TEXT["num_layers"] and not report.left, str(report)
    swapped = attention_layers(backbone)
    assert len(swapped) == TEXT["num_layers"]
    for layer in swapped:
        query, value = projections(layer)
        if mode == "lora":
            assert query.lora_enabled and value.lora_enabled
        else:
            assert query.quantization_mode == "int8"
    # The weights as they were: count, order, paths, what trains, int8 kernels still int8.
    assert [(w.path, w.trainable, str(w.dtype)) for w in backbone.weights] == paths
    np.testing.assert_allclose(numpy(sequence(backbone(x))), want, atol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.default_cases("llama-lora")
@pytest.mark.parametrize("mode", ["lora", "int8"])
@pytest.mark.parametrize("name", list(BACKBONES))
def test_a_model_swapped_then_adapted_computes_what_the_adapted_stock_one_does(name, mode):
    """The other order: swapped first, then LoRA-enabled or quantized, against the stock
    model adapted the same way (the same factors, the same int8 kernels)."""
    stock, ours = adapted(name, mode), adapted(name, mode, swap_first=True)
    assert len(attention_layers(ours)) == TEXT["num_layers"]
    x = inputs(stock)
    want = numpy(sequence(stock(x)))
    assert [(w.path, w.trainable) for w in ours.weights] == [
        (w.path, w.trainable) for w in stock.weights
    ]
    np.testing.assert_allclose(numpy(sequence(ours(x))), want, atol=1e-5)


@pytest.mark.large
def test_a_lora_model_trains_after_the_swap_as_before():
    """Two SGD steps on the LoRA factors give the stock model's losses and factors."""
    models = [adapted("bert", "lora") for _ in range(2)]
    keras_sdpa.replace_attention(models[1])
    x = inputs(models[0])
    y = np.random.default_rng(2).normal(size=(B, T, TEXT["hidden_dim"])).astype("float32")
    histories = []
    for backbone in models:
        model = keras.Model(backbone.inputs, sequence(backbone.output))
        model.compile(keras.optimizers.SGD(0.1), "mse")
        histories.append(model.fit(x, y, batch_size=B, epochs=2, verbose=0).history["loss"])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)
    factors = [[numpy(w) for w in m.trainable_weights if "lora" in w.path] for m in models]
    assert factors[0]
    for got, want in zip(factors[1], factors[0]):
        np.testing.assert_allclose(got, want, atol=1e-5)
