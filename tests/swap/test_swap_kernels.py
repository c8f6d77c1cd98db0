"""`replace_attention` on the decoder families that write their own attention class: the class
stays (projections, rotary embeddings, norms, cache) and its kernel runs on the core.

The differential harness of tests/swap/test_swap_families.py: each family built tiny from its
constructor, twice, the stock model the reference. The forward pass, every output within 1e-5
of its scale, without padding, with padding and with a row of padding only (default tier), and
greedy `generate` giving the stock tokens for the families whose causal LM builds with
`preprocessor=None` (large). Each family's options that reach its kernel are set: GQA, Gemma 2's
soft cap and sliding window, Mistral's and Qwen's windows. A spy on the core proves that the
swapped kernels ran on it (the stock kernels would give the same numbers).
"""

import collections
import functools

import keras
import numpy as np
import pytest
from keras_hub.src.models.bloom.bloom_backbone import BloomBackbone
from keras_hub.src.models.bloom.bloom_causal_lm import BloomCausalLM
from keras_hub.src.models.falcon.falcon_backbone import FalconBackbone
from keras_hub.src.models.falcon.falcon_causal_lm import FalconCausalLM
from keras_hub.src.models.gemma.gemma_backbone import GemmaBackbone
from keras_hub.src.models.gemma.gemma_causal_lm import GemmaCausalLM
from keras_hub.src.models.gemma3.gemma3_backbone import Gemma3Backbone
from keras_hub.src.models.gpt_neo_x.gpt_neo_x_backbone import GPTNeoXBackbone
from keras_hub.src.models.gpt_neo_x.gpt_neo_x_causal_lm import GPTNeoXCausalLM
from keras_hub.src.models.llama.llama_backbone import LlamaBackbone
from keras_hub.src.models.llama.llama_causal_lm import LlamaCausalLM
from keras_hub.src.models.mistral.mistral_backbone import MistralBackbone
from keras_hub.src.models.mistral.mistral_causal_lm import MistralCausalLM
from keras_hub.src.models.mixtral.mixtral_backbone import MixtralBackbone
from keras_hub.src.models.mixtral.mixtral_causal_lm import MixtralCausalLM
from keras_hub.src.models.phi3.phi3_backbone import Phi3Backbone
from keras_hub.src.models.phi3.phi3_causal_lm import Phi3CausalLM
from keras_hub.src.models.qwen.qwen_backbone import QwenBackbone
from keras_hub.src.models.qwen.qwen_causal_lm import QwenCausalLM
from keras_hub.src.models.qwen3.qwen3_backbone import Qwen3Backbone
from keras_hub.src.models.qwen3.qwen3_causal_lm import Qwen3CausalLM
from keras_hub.src.models.qwen3_moe.qwen3_moe_backbone import Qwen3MoeBackbone
from keras_hub.src.models.qwen3_moe.qwen3_moe_causal_lm import Qwen3MoeCausalLM
from keras_hub.src.models.qwen_moe.qwen_moe_backbone import QwenMoeBackbone
from keras_hub.src.models.qwen_moe.qwen_moe_causal_lm import QwenMoeCausalLM
from keras_hub.src.models.smollm3.smollm3_backbone import SmolLM3Backbone
from keras_hub.src.models.smollm3.smollm3_causal_lm import SmolLM3CausalLM
from keras_hub.src.models.t5.t5_backbone import T5Backbone
from keras_hub.src.models.whisper.whisper_backbone import WhisperBackbone
from test_swap import twins
from test_swap_families import (
    EAGER_REFERENCE,
    PADDING,
    VOCAB,
    assert_fits_alike,
    assert_same_outputs,
    feed,
    prompts,
)

import keras_sdpa
from keras_sdpa import ops as core
from keras_sdpa._swap import families as _kernels

partial = functools.partial
DECODER = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=16, intermediate_dim=32)
GQA = dict(DECODER, num_query_heads=4, num_key_value_heads=2)
# Windows of 3 keys and a soft cap of 2: smaller than the inputs and the logits, so they count.
GEMMA2 = dict(
    GQA,
    head_dim=8,
    attention_logit_soft_cap=2.0,
    use_sliding_window_attention=True,
    sliding_window_size=3,
    query_head_dim_normalize=False,
)
MOE = dict(GQA, num_experts=2, top_k=1)
SMOLLM3 = dict(
    vocabulary_size=VOCAB,
    hidden_dim=16,
    intermediate_dim=32,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=False,
    attention_dropout=0.0,
    rope_layer_enabled_list=[True, False],
    layer_types=["attention", "attention"],
    mlp_bias=False,
    layer_norm_epsilon=1e-6,
    max_position_embeddings=32,
    rope_theta=1e4,
    partial_rotary_factor=1.0,
)

FAMILIES = {
    # name: (backbone, the attention class, its causal LM or None)
    "llama": (partial(LlamaBackbone, **GQA), "LlamaAttention", LlamaCausalLM),
    "mistral": (
        partial(MistralBackbone, **GQA, sliding_window=3),
        "CachedMistralAttention",
        MistralCausalLM,
    ),
    "mixtral": (
        partial(MixtralBackbone, **MOE, sliding_window=3),
        "CachedMixtralAttention",
        MixtralCausalLM,
    ),
    "phi3": (partial(Phi3Backbone, **GQA), "Phi3Attention", Phi3CausalLM),
    "gemma": (partial(GemmaBackbone, **GQA, head_dim=8), "CachedGemmaAttention", GemmaCausalLM),
    "gemma2": (partial(GemmaBackbone, **GEMMA2), "CachedGemmaAttention", GemmaCausalLM),
    # The stock Gemma3CausalLM built so (no preprocessor, no images) cannot generate.
    "gemma3": (partial(Gemma3Backbone, **GEMMA2, image_size=16), "CachedGemma3Attention", None),
    "qwen": (partial(QwenBackbone, **GQA), "QwenAttention", QwenCausalLM),
    # The stock Qwen with its window cannot generate (`cache_update_index or 0` on a tensor).
    "qwen_window": (
        partial(QwenBackbone, **GQA, use_sliding_window_attention=True, sliding_window_size=3),
        "QwenAttention",
        None,
    ),
    "qwen_moe": (
        partial(QwenMoeBackbone, **MOE, moe_intermediate_dim=8, shared_expert_intermediate_dim=8),
        "QwenMoeAttention",
        QwenMoeCausalLM,
    ),
    "qwen3": (
        partial(Qwen3Backbone, **GQA, head_dim=4, sliding_window_size=3),
        "Qwen3Attention",
        Qwen3CausalLM,
    ),
    "qwen3_moe": (
        partial(Qwen3MoeBackbone, **MOE, moe_intermediate_dim=8, head_dim=4, sliding_window_size=3),
        "Qwen3MoeAttention",
        Qwen3MoeCausalLM,
    ),
    "smollm3": (partial(SmolLM3Backbone, **SMOLLM3), "SmolLM3Attention", SmolLM3CausalLM),
    "gpt_neo_x": (
        partial(GPTNeoXBackbone, **DECODER, num_heads=2, dropout=0.0),
        "GPTNeoXAttention",
        GPTNeoXCausalLM,
    ),
    # Kernels written inside `call`, with ALiBi: `call` replaced (the class's sublayers kept).
    "bloom": (partial(BloomBackbone, **DECODER, num_heads=4), "BloomAttention", BloomCausalLM),
    "falcon": (
        partial(FalconBackbone, **DECODER, num_attention_heads=4),
        "FalconAttention",
        FalconCausalLM,
    ),
    # T5's relative-position bias, made by the first layer and handed on (with the mask in it):
    # the encoder's self-attention, the decoder's self- and cross-attention.
    "t5": (partial(T5Backbone, **DECODER, num_heads=2, dropout=0.0), "T5MultiHeadAttention", None),
    # A subclass of keras-hub's cached attention whose key projection has no bias: the
    # encoder's self-attention, the decoder's causal self-attention and its cross-attention.
    "whisper": (
        partial(
            WhisperBackbone,
            **DECODER,
            num_heads=2,
            num_mels=8,
            max_encoder_sequence_length=16,
            max_decoder_sequence_length=8,
        ),
        "WhisperCachedMultiHeadAttention",
        None,
    ),
}
# The attention layers of each family: one per layer, Whisper's three.
ATTENTION_LAYERS = {"whisper": 3 * DECODER["num_layers"], "t5": 3 * DECODER["num_layers"]}
WITH_LM = [name for name, (_, _, task) in FAMILIES.items() if task is not None]


def swap_kernels(model, expected, name=None):
    report = keras_sdpa.replace_attention(model)
    kinds = collections.Counter(kind for _, kind in report.kernels)
    count = ATTENTION_LAYERS.get(name, DECODER["num_layers"])
    assert kinds == {expected: count} and not report.left, str(report)
    assert report.swapped == [], str(report)
    return report


@pytest.fixture
def core_calls(monkeypatch):
    """The keyword arguments of every call of the core (eager, or traced by a compiled
    function), with `key_heads`, the heads of the keys it was handed."""
    calls = []
    real = core.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(dict(kwargs, key_heads=args[1].shape[-2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "scaled_dot_product_attention", counted)
    return calls


def implementations(calls):
    return [kwargs.get("implementation") for kwargs in calls]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_kernel_swapped_family_gives_the_stock_outputs(name, core_calls):
    build, expected, _ = FAMILIES[name]
    stock, ours = twins(build)
    swap_kernels(ours, expected, name)
    for case, padding in PADDING.items():
        inputs = feed(stock, padding)
        before = len(core_calls)
        assert_same_outputs(ours(inputs), stock(inputs), case)
        count = ATTENTION_LAYERS.get(name, DECODER["num_layers"])
        assert len(core_calls) - before == count, "the core did not run"
    # Grouped-query attention reaches the core grouped: each key/value head once, not the
    # copies a Llama-style class repeats to the query heads before its kernel.
    kv_heads = getattr(stock, "num_key_value_heads", None)
    if kv_heads is not None:
        assert {call["key_heads"] for call in core_calls} == {kv_heads}


def test_a_second_swap_reports_nothing_new_and_its_options_replace_the_first(core_calls):
    build, expected, _ = FAMILIES["llama"]
    stock, model = twins(build)
    swap_kernels(model, expected)
    report = keras_sdpa.replace_attention(model, flash_attention=True, chunk_size=4)
    assert report.kernels == [] and report.swapped == [] and report.left == []
    assert "Kernel swapped" not in str(report)
    inputs = feed(stock, PADDING["padding"])
    assert_same_outputs(model(inputs), stock(inputs))
    assert implementations(core_calls) == ["chunked"] * DECODER["num_layers"]


@pytest.mark.large
@pytest.mark.parametrize("name", WITH_LM)
def test_the_kernel_swapped_family_generates_the_stock_greedy_tokens(name, core_calls):
    build, expected, task = FAMILIES[name]

    def lm():
        model = task(backbone=build(), preprocessor=None)
        model.compile(sampler="greedy")
        return model

    stock, ours = twins(lm)
    stock.compile(sampler="greedy", run_eagerly=EAGER_REFERENCE)
    inputs = prompts(stock.backbone)
    want = stock.generate(inputs, stop_token_ids=None)
    swap_kernels(ours, expected)
    got = ours.generate(inputs, stop_token_ids=None)
    assert core_calls, "the core did not run"
    kv_heads = getattr(stock.backbone, "num_key_value_heads", None)
    if kv_heads is not None:  # the cached calls' keys (the cache's) grouped too
        assert {call["key_heads"] for call in core_calls} == {kv_heads}
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# The constructor argument that sets the dropout of a family's attention weights.
DROPOUT = {
    "gemma": "dropout",
    "gpt_neo_x": "dropout",
    "whisper": "dropout",
    "bloom": "dropout",
    "t5": "dropout",
    "falcon": "attention_dropout_rate",
}


@pytest.mark.default_cases("gemma", "bloom")
@pytest.mark.parametrize("name", DROPOUT)
def test_a_kernel_with_dropout_matches_stock_at_inference_and_drops_in_training(name, core_calls):
    """Gemma, GPT-NeoX, Whisper, Bloom, Falcon and T5 drop attention weights inside their
    kernels: the swapped kernel gives stock's outputs at inference (Whisper's, with dropout,
    off Keras's fused op: a fully masked row gives zeros there), and in training the core
    draws the dropout itself, at the family's rate (a spy on its arguments)."""
    build, expected, _ = FAMILIES[name]
    stock, ours = twins(partial(build, **{DROPOUT[name]: 0.5}))
    swap_kernels(ours, expected, name)
    for case, padding in PADDING.items():
        inputs = feed(stock, padding)
        want = stock(inputs, training=False)
        assert_same_outputs(ours(inputs, training=False), want, case)
    assert core_calls and all(kwargs["dropout_rate"] == 0.0 for kwargs in core_calls)
    del core_calls[:]
    inputs = feed(stock, PADDING["padding"])
    trained = keras.tree.flatten(ours(inputs, training=True))
    count = ATTENTION_LAYERS.get(name, DECODER["num_layers"])
    assert [(kwargs["dropout_rate"], kwargs["training"]) for kwargs in core_calls] == [
        (0.5, True)
    ] * count
    for got in trained:
        assert np.isfinite(keras.ops.convert_to_numpy(got)).all()


def test_flash_attention_reaches_a_swapped_kernel_and_other_options_are_refused(core_calls):
    build, expected, _ = FAMILIES["llama"]
    stock, ours = twins(build)
    with pytest.raises(ValueError, match="only `flash_attention`.*Received: use_gate"):
        keras_sdpa.replace_attention(ours, use_gate=True)
    report = keras_sdpa.replace_attention(ours, flash_attention=True, chunk_size=4)
    assert len(report.kernels) == DECODER["num_layers"]
    inputs = feed(stock, PADDING["padding"])
    assert_same_outputs(ours(inputs), stock(inputs))
    assert core_calls and set(implementations(core_calls)) == {"chunked"}


def _kernel_swapped_layers(model):
    return [layer for layer in model._flatten_layers() if _kernels.is_swapped(layer)]


@pytest.mark.default_cases("llama", "whisper")
@pytest.mark.parametrize("name", ["llama", "gemma2", "whisper", "bloom", "t5"])
def test_a_family_built_or_loaded_in_the_scope_runs_its_kernel_on_the_core(
    name, core_calls, tmp_path
):
    """`sdpa_scope` swaps the kernels of the family classes constructed inside it, as
    `replace_attention` does; the model saves as the stock one, loads stock outside the
    scope and swapped again inside it, with the stock outputs each time."""
    build, _, _ = FAMILIES[name]
    keras.utils.set_random_seed(0)
    stock = build()
    attention_class = next(
        type(layer) for layer in stock._flatten_layers() if _kernels.family_of(layer)
    )
    own_init = vars(attention_class).get("__init__")  # None where it inherits one (Whisper)
    count = ATTENTION_LAYERS.get(name, DECODER["num_layers"])
    with keras_sdpa.sdpa_scope(flash_attention=True, chunk_size=4):
        keras.utils.set_random_seed(1)
        ours = build()
    ours.set_weights(stock.get_weights())
    assert len(_kernel_swapped_layers(ours)) == count
    assert not _kernel_swapped_layers(build()), "a model built after the scope was swapped"
    restored = vars(attention_class).get("__init__")
    assert restored is own_init, "the constructor was not restored"
    path = str(tmp_path / f"{name}.keras")
    ours.save(path)
    plain = keras.saving.load_model(path)
    with keras_sdpa.sdpa_scope():
        scoped = keras.saving.load_model(path)
    assert not _kernel_swapped_layers(plain)
    assert len(_kernel_swapped_layers(scoped)) == count
    for case, padding in PADDING.items():
        inputs = feed(stock, padding)
        want = stock(inputs)
        del core_calls[:]
        for label, model in (("built", ours), ("loaded in the scope", scoped)):
            assert_same_outputs(model(inputs), want, f"{label}, {case}")
        assert implementations(core_calls) == ["chunked"] * count + ["auto"] * count
        assert_same_outputs(plain(inputs), want, f"loaded, {case}")


def with_mean_head(backbone, eager=False):
    """`backbone` under a one-unit head on its mean output over the tokens (a decoder's first
    token sees only itself), compiled with clipped SGD as the harness's other families."""
    keras.utils.set_random_seed(2)  # the same head on both twins
    outputs = keras.tree.flatten(backbone.output)  # Whisper's: the encoder's and decoder's
    pooled = keras.ops.concatenate([keras.ops.mean(x, axis=1) for x in outputs], axis=-1)
    model = keras.Model(backbone.input, keras.layers.Dense(1, name="head")(pooled))
    optimizer = keras.optimizers.SGD(0.01, clipnorm=1.0)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=eager)
    return model


@pytest.mark.default_cases("llama", "gemma2")
@pytest.mark.parametrize("name", FAMILIES)
def test_the_kernel_swapped_family_fits_as_the_stock_one(name, core_calls):
    """Two `fit` steps (Keras's compiled train step; the stock reference eagerly on
    TensorFlow) give the stock losses and weights."""
    build, expected, _ = FAMILIES[name]
    stock, ours = twins(build)
    swap_kernels(ours, expected, name)
    stock, ours = with_mean_head(stock, eager=EAGER_REFERENCE), with_mean_head(ours)
    assert_fits_alike(stock, ours, changed=1e-3)
    assert core_calls, "the core did not run"


@pytest.mark.default_cases("gemma2")
@pytest.mark.parametrize("name", ["llama", "gemma2", "bloom", "falcon", "t5", "whisper"])
def test_under_mixed_bfloat16_the_swap_is_within_the_stock_models_own_error(name):
    """Under `mixed_bfloat16` (the same weights), the swapped model is as close to the float32
    model as the stock bfloat16 model is: within twice its error, plus 1% of the output's
    scale (bfloat16 keeps 8 bits; the two round in different places)."""
    build = FAMILIES[name][0]
    keras.utils.set_random_seed(0)
    reference = build()
    weights = reference.get_weights()
    stock, ours = build(dtype="mixed_bfloat16"), build(dtype="mixed_bfloat16")
    stock.set_weights(weights)
    ours.set_weights(weights)
    swap_kernels(ours, FAMILIES[name][1], name)
    for case, padding in PADDING.items():
        inputs = feed(reference, padding)
        outputs = [keras.tree.flatten(model(inputs)) for model in (reference, stock, ours)]
        for want, got_stock, got in zip(*outputs):
            want = keras.ops.convert_to_numpy(want)
            scale = float(np.max(np.abs(want)))
            stock_error = np.max(np.abs(keras.ops.convert_to_numpy(got_stock) - want))
            error = np.max(np.abs(keras.ops.convert_to_numpy(got) - want))
            assert stock_error > 0, "the stock model did not round in bfloat16"
            assert error <= 2 * stock_error + 0.01 * scale, (case, error, stock_error, scale)


def test_a_zero_soft_cap_is_left_with_its_reason_and_computes_as_stock(core_calls):
    """keras-hub takes Gemma's `attention_logit_soft_cap=0.0` (every stock logit becomes
    `0 * tanh(s / 0)`); the core refuses a cap of 0, so `replace_attention` and `sdpa_scope`
    leave the class's kernel and say why, and the model computes as stock does."""
    build = partial(GemmaBackbone, **dict(GEMMA2, attention_logit_soft_cap=0.0))
    stock, ours = twins(build)
    report = keras_sdpa.replace_attention(ours)
    assert report.kernels == [] and len(report.left) == DECODER["num_layers"], str(report)
    assert all("attn_logits_soft_cap" in why and "0.0" in why for _, _, why in report.left)
    with pytest.warns(UserWarning, match="sdpa_scope left .*attn_logits_soft_cap"):
        with keras_sdpa.sdpa_scope():
            scoped = build()
    scoped.set_weights(stock.get_weights())
    assert not _kernel_swapped_layers(ours) and not _kernel_swapped_layers(scoped)
    inputs = feed(stock, PADDING["padding"])
    want = stock(inputs)
    assert_same_outputs(ours(inputs), want)
    assert_same_outputs(scoped(inputs), want)
    assert core_calls == []
