"""`keras_sdpa.replace_attention` on every keras-hub model family that can be built small.

The swap's differential harness. Each family whose blocks use Keras's attention classes
(`keras.layers.MultiHeadAttention`, `keras.layers.GroupQueryAttention`, keras-hub's
`CachedMultiHeadAttention`) is built twice from its constructor, with a tiny random
configuration (nothing is downloaded): as shipped, and swapped after building, with the stock
model's weights (`twins` and `replace` of tests/swap/test_swap.py: the replaced layers then get
other weights, so a model that still called one would give other numbers). The stock model is
the reference, each family one line of `FAMILIES`:

- the forward pass, every output at every position within 1e-5: without padding, with
  padding (token id 0, `False` in the padding mask) and with a row that is all padding (its
  attention rows fully masked), where the family takes a padding mask;
- two steps of `fit` (SGD, the same data) give the same losses and weights;
- greedy `generate` gives the same tokens, where the family has a causal or seq2seq LM task
  that builds with `preprocessor=None`: the task swapped, or its backbone swapped after the
  task has generated once;
- the swapped model saved to `.keras` and loaded (plainly, and inside `sdpa_scope()`) gives
  the same outputs.

The forward pass of every family is in the default tier (about 30 s on TensorFlow, one core);
the other checks are large. `REFUSED` lists families whose attention is their own class or a
subclass of Keras's: the report must name those layers with its reason, and the model must
compute what it did.
"""

import collections
import dataclasses
import functools

import keras
import numpy as np
import pytest
from keras_hub.src.models.albert.albert_backbone import AlbertBackbone
from keras_hub.src.models.bart.bart_backbone import BartBackbone
from keras_hub.src.models.bart.bart_seq_2_seq_lm import BartSeq2SeqLM
from keras_hub.src.models.bert.bert_backbone import BertBackbone
from keras_hub.src.models.clip.clip_backbone import CLIPBackbone
from keras_hub.src.models.clip.clip_text_encoder import CLIPTextEncoder
from keras_hub.src.models.clip.clip_vision_encoder import CLIPVisionEncoder
from keras_hub.src.models.deberta_v3.deberta_v3_backbone import DebertaV3Backbone
from keras_hub.src.models.deit.deit_backbone import DeiTBackbone
from keras_hub.src.models.dinov2.dinov2_backbone import DINOV2Backbone
from keras_hub.src.models.distil_bert.distil_bert_backbone import DistilBertBackbone
from keras_hub.src.models.edrec.edrec_backbone import EdRecBackbone
from keras_hub.src.models.edrec.edrec_seq2seq_lm import EdRecSeq2SeqLM
from keras_hub.src.models.electra.electra_backbone import ElectraBackbone
from keras_hub.src.models.gpt2.gpt2_backbone import GPT2Backbone
from keras_hub.src.models.gpt2.gpt2_causal_lm import GPT2CausalLM
from keras_hub.src.models.metaclip_2.metaclip_2_backbone import MetaCLIP2Backbone
from keras_hub.src.models.metaclip_2.metaclip_2_text_encoder import MetaCLIP2TextEncoder
from keras_hub.src.models.metaclip_2.metaclip_2_vision_encoder import MetaCLIP2VisionEncoder
from keras_hub.src.models.opt.opt_backbone import OPTBackbone
from keras_hub.src.models.opt.opt_causal_lm import OPTCausalLM
from keras_hub.src.models.parseq.parseq_backbone import PARSeqBackbone
from keras_hub.src.models.roberta.roberta_backbone import RobertaBackbone
from keras_hub.src.models.sam3.sam3_text_encoder import SAM3TextEncoder
from keras_hub.src.models.siglip.siglip_backbone import SigLIPBackbone
from keras_hub.src.models.siglip.siglip_text_encoder import SigLIPTextEncoder
from keras_hub.src.models.siglip.siglip_vision_encoder import SigLIPVisionEncoder
from keras_hub.src.models.vit.vit_backbone import ViTBackbone
from keras_hub.src.models.xlm_roberta.xlm_roberta_backbone import XLMRobertaBackbone
from keras_hub.src.models.xlnet.xlnet_backbone import XLNetBackbone
from test_swap import attention_kinds, replace, same_weights, twins

import keras_sdpa
from keras_sdpa import ScaledDotProductAttention

# Batch, text (and encoder) length, decoder length, the length `generate` fills, image side,
# patch side, vocabulary: pairwise distinct, so that a swapped axis cannot pass.
B, T, D, G, IMAGE, PATCH, VOCAB = 2, 7, 5, 12, 16, 4, 53
# keras-hub's own tests' tiny configurations: 2 layers, width 16, 2 heads, no dropout.
LAYERS = dict(num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32)
TEXT = dict(LAYERS, vocabulary_size=VOCAB, dropout=0.0, max_sequence_length=16)
IMAGES = dict(image_shape=(IMAGE, IMAGE, 3), patch_size=PATCH)
VIT = dict(IMAGES, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32)  # its MLP's name
MHA, CACHED = "MultiHeadAttention", "CachedMultiHeadAttention"


def towers(backbone, vision, text, **options):
    """A two-tower backbone (CLIP's, MetaCLIP 2's, SigLIP's) of two tiny towers."""
    text = text(vocabulary_size=VOCAB, embedding_dim=16, max_sequence_length=T, **LAYERS)
    return backbone(vision_encoder=vision(**IMAGES, **LAYERS), text_encoder=text, **options)


def clip():
    return towers(CLIPBackbone, CLIPVisionEncoder, CLIPTextEncoder, projection_dim=8)


def metaclip_2():
    return towers(MetaCLIP2Backbone, MetaCLIP2VisionEncoder, MetaCLIP2TextEncoder, projection_dim=8)


def siglip():
    return towers(SigLIPBackbone, SigLIPVisionEncoder, SigLIPTextEncoder)


def dinov2():
    return DINOV2Backbone(**IMAGES, **LAYERS, position_embedding_shape=(IMAGE, IMAGE, 3))


def edrec():
    return EdRecBackbone(
        vocab_size=VOCAB,
        num_layers_enc=2,
        num_layers_dec=2,
        hidden_dim=16,
        intermediate_dim=32,
        num_heads=2,
    )


def electra():
    text = {key: value for key, value in TEXT.items() if key != "vocabulary_size"}
    return ElectraBackbone(vocab_size=VOCAB, embedding_dim=8, **text)


def parseq():
    """PARSeq: a ViT image encoder, and a decoder of `CachedMultiHeadAttention`."""
    return PARSeqBackbone(
        image_encoder=ViTBackbone(**VIT, include_rescaling=False),
        vocabulary_size=VOCAB,
        max_label_length=T - 1,
        decoder_hidden_dim=16,
        num_decoder_layers=1,
        num_decoder_heads=2,
        decoder_mlp_dim=32,
        dropout_rate=0.0,
        attention_dropout=0.0,
    )


def sam3_text():
    """SAM 3's text encoder, a layer: in a functional model of its two inputs."""
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    mask = keras.Input((None,), dtype="bool", name="padding_mask")
    encoder = SAM3TextEncoder(vocabulary_size=VOCAB, embedding_dim=16, **LAYERS)
    return keras.Model({"token_ids": ids, "padding_mask": mask}, encoder(ids, mask))


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build a family small, and what the swap must report for it.

    Attributes:
        build: makes the backbone, built.
        swapped: `{class name: count}` of the layers the report must swap.
        task: its causal or seq2seq LM class, built with `preprocessor=None`, or None.
    """

    build: object
    swapped: dict
    task: object = None


partial = functools.partial
FAMILIES = {
    "albert": Family(partial(AlbertBackbone, **TEXT, embedding_dim=8), {MHA: 1}),  # one, shared
    "bart": Family(partial(BartBackbone, **TEXT), {MHA: 2, CACHED: 4}, BartSeq2SeqLM),
    "bert": Family(partial(BertBackbone, **TEXT), {MHA: 2}),
    "clip": Family(clip, {MHA: 4}),
    "deit": Family(partial(DeiTBackbone, **IMAGES, **LAYERS), {MHA: 2}),
    "dinov2": Family(dinov2, {MHA: 2}),
    "distil_bert": Family(partial(DistilBertBackbone, **TEXT), {MHA: 2}),
    "edrec": Family(edrec, {MHA: 2, CACHED: 4}, EdRecSeq2SeqLM),
    "electra": Family(electra, {MHA: 2}),
    "gpt2": Family(partial(GPT2Backbone, **TEXT), {CACHED: 2}, GPT2CausalLM),
    "metaclip_2": Family(metaclip_2, {MHA: 4}),
    "opt": Family(partial(OPTBackbone, **TEXT), {CACHED: 2}, OPTCausalLM),
    # PARSeq's causal LM compiles in its constructor, with a loss that reads its preprocessor's
    # tokenizer: it cannot be built with `preprocessor=None`.
    "parseq": Family(parseq, {MHA: 2, CACHED: 2}),
    "roberta": Family(partial(RobertaBackbone, **TEXT), {MHA: 2}),
    "sam3_text": Family(sam3_text, {MHA: 2}),
    "siglip": Family(siglip, {MHA: 5}),  # the vision tower's pooling head holds one more
    "vit": Family(partial(ViTBackbone, **VIT), {MHA: 2}),
    "xlm_roberta": Family(partial(XLMRobertaBackbone, **TEXT), {MHA: 2}),
}
WITH_LM = [name for name, family in FAMILIES.items() if family.task is not None]


# The padding of the first row (id 0, mask False): its last `PADDING[case]` positions, or all.
PADDING = {"no padding": 0, "padding": 3, "an all-padding row": None}


def tokens(prefix, padding, length=None):
    """`(token_ids, padding_mask)` of the inputs named `prefix...`, the first row's last
    `padding` positions padding (all of them where None)."""
    length = length or (D if prefix == "decoder_" else T)
    rng = np.random.default_rng(len(prefix))
    ids = rng.integers(1, VOCAB, (B, length)).astype("int32")
    mask = np.ones((B, length), bool)
    first = 0 if padding is None else length - padding
    ids[0, first:], mask[0, first:] = 0, False
    return ids, mask


def feed(model, padding):
    """Inputs for `model`, from the names, shapes and dtypes of its `keras.Input`s."""
    specs = model.input if isinstance(model.input, dict) else {"images": model.input}
    rng = np.random.default_rng(7)
    out = {}
    for name, spec in specs.items():
        prefix = name.removesuffix("token_ids").removesuffix("padding_mask")
        if name.endswith(("token_ids", "padding_mask")):
            ids, mask = tokens(prefix, padding, length=spec.shape[1])
            out[name] = ids if name.endswith("token_ids") else mask.astype(spec.dtype)
        elif name == "segment_ids":
            out[name] = np.zeros((B, T), "int32")
        else:  # images, or audio
            shape = [T if size is None else size for size in spec.shape[1:]]
            out[name] = rng.random((B, *shape)).astype("float32")
    return out if isinstance(model.input, dict) else out["images"]


def assert_same_outputs(got, want, case=""):
    """Every output within 1e-5 of the output's scale (its largest magnitude, at least 1).

    Scaled: EdRec's outputs reach 18 (it has no final norm), and its stock model on JAX,
    eager against `jax.jit`, differs from itself by 3.3e-5 (the swapped one from it by
    3.3e-5 too)."""
    got, want = keras.tree.flatten(got), keras.tree.flatten(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        atol = 1e-5 * max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5, err_msg=f"{case}, output {i}")


def swapped_twins(name):
    """The stock backbone of family `name` and its swapped twin, on the stock's weights."""
    family = FAMILIES[name]
    stock, ours = twins(family.build)
    report = replace(ours)
    assert collections.Counter(kind for _, kind in report.swapped) == family.swapped, report
    assert report.left == [], report
    assert collections.Counter(attention_kinds(ours))["ScaledDotProductAttention"] == sum(
        family.swapped.values()
    )
    same_weights(stock, ours)
    return stock, ours


@pytest.mark.parametrize("name", FAMILIES)
def test_the_swapped_family_gives_the_stock_outputs_with_and_without_padding(name):
    stock, ours = swapped_twins(name)
    for case, padding in PADDING.items():
        inputs = feed(stock, padding)
        assert_same_outputs(ours(inputs), stock(inputs), case)


# The stock references run eagerly on TensorFlow, where the compiled step on CPU is a graph of
# the same ops (no XLA): tracing it would only add time. On JAX their step stays compiled:
# JAX's eager and jit results differ in rounding (EdRec's second loss by 1.6e-5, relative).
EAGER_REFERENCE = keras.backend.backend() == "tensorflow"


def with_head(backbone, eager=False):
    """`backbone` under a one-unit head on its first-token (or pooled) outputs; `eager`: its
    `fit` runs eagerly."""
    features = []
    for output in keras.tree.flatten(backbone.output):
        if len(output.shape) == 3:
            output = output[:, 0, :]  # (B, E)
        elif output.shape[-1] is None:  # two towers' logits, (B, B)
            output = keras.ops.mean(output, axis=-1, keepdims=True)  # (B, 1)
        features.append(output)
    keras.utils.set_random_seed(2)  # the same head on both twins
    head = keras.layers.Dense(1, name="head")
    model = keras.Model(backbone.input, head(keras.ops.concatenate(features, axis=-1)))
    # Each gradient clipped to norm 1: tiny random embeddings under a norm get gradients
    # 50-400x the others' (EdRec's 360), and a plain SGD step of 1e-3 or even 1e-4 raised the
    # loss of 13 of 18 families tenfold. Clipped each on its own (not by the global norm, under
    # which the embeddings' gradient left the attention weights of the text families steps
    # of 1e-8), the attention weights move by 1e-5 (text) to 1e-2 (vision) per step.
    optimizer = keras.optimizers.SGD(0.01, clipnorm=1.0)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=eager)
    return model


def assert_fits_alike(stock, ours, changed):
    """Two `fit` steps of each model, the swapped one in Keras's compiled train step: the
    stock losses (the first step moved the loss by more than `changed`) and weights."""
    inputs = feed(stock, PADDING["padding"])
    targets = np.array([[0.5], [-1.0]], "float32")
    losses = []
    for model in (stock, ours):
        keras.utils.set_random_seed(3)
        history = model.fit(inputs, targets, batch_size=B, epochs=2, shuffle=False, verbose=0)
        losses.append(history.history["loss"])
    assert not ours.run_eagerly
    assert abs(losses[0][1] - losses[0][0]) > changed, losses
    # The second loss to 1e-4: EdRec's is that sensitive to rounding in the first step (its
    # embeddings' gradient, 360). On JAX its stock model alone, eager against jit, gave
    # 2.229427 and 2.229462 (1.6e-5 apart, relative), the swapped one 2.229448.
    np.testing.assert_allclose(losses[1], losses[0], atol=1e-5, rtol=1e-4)
    for a, b in zip(stock.weights, ours.weights, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(b),
            keras.ops.convert_to_numpy(a),
            atol=1e-5,
            rtol=1e-5,
            err_msg=a.path,
        )


@pytest.mark.large
@pytest.mark.parametrize("name", FAMILIES)
def test_the_swapped_family_fits_as_the_stock_one(name):
    stock, ours = swapped_twins(name)
    stock, ours = with_head(stock, eager=EAGER_REFERENCE), with_head(ours)
    assert_fits_alike(stock, ours, changed=1e-2)


def prompts(backbone):
    """Prompts of 3 and 5 tokens in `G` positions (2 and 3 for a decoder), after a padded
    encoder input: the decoder runs longer than the encoder."""
    inputs = feed(backbone, PADDING["padding"])
    for prefix, lengths in (("", (3, 5)), ("decoder_", (2, 3))):
        if f"{prefix}token_ids" not in inputs:
            continue
        ids, _ = tokens(prefix, 0, length=G)
        mask = np.arange(G)[None, :] < np.array(lengths)[:, None]  # (B, G)
        inputs[f"{prefix}token_ids"] = np.where(mask, ids, 0).astype("int32")
        inputs[f"{prefix}padding_mask"] = mask.astype(backbone.input[f"{prefix}padding_mask"].dtype)
    return inputs


@pytest.mark.large
@pytest.mark.parametrize("after_generate", [False, True], ids=["task", "backbone_after_generate"])
@pytest.mark.parametrize("name", WITH_LM)
def test_the_swapped_family_generates_the_stock_greedy_tokens(name, after_generate):
    """Greedy `generate` of the family's LM task: swapped as a whole, or (as a user with
    `lm.backbone` would) its backbone swapped after the task has generated once."""
    family = FAMILIES[name]

    def lm():
        task = family.task(backbone=family.build(), preprocessor=None)
        task.compile(sampler="greedy")
        return task

    stock, ours = twins(lm)
    inputs = prompts(stock.backbone)
    want = stock.generate(inputs, stop_token_ids=None)
    if after_generate:
        ours.generate(inputs, stop_token_ids=None)
    report = replace(ours.backbone if after_generate else ours)
    assert collections.Counter(kind for _, kind in report.swapped) == family.swapped, report
    got = ours.generate(inputs, stop_token_ids=None)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.large
@pytest.mark.parametrize("name", FAMILIES)
def test_the_swapped_family_saved_and_loaded_gives_the_stock_outputs(
    name, tmp_path, record_property
):
    """A `.keras` round trip: loaded as it is, and loaded inside `sdpa_scope()`, which keeps
    this layer also where the model's own code constructs its attention (keras-hub's
    blocks)."""
    stock, ours = swapped_twins(name)
    path = str(tmp_path / f"{name}.keras")
    ours.save(path)
    loaded = keras.saving.load_model(path)
    with keras_sdpa.sdpa_scope():
        scoped = keras.saving.load_model(path)
    for case, padding in PADDING.items():
        inputs = feed(stock, padding)
        want = stock(inputs)
        assert_same_outputs(loaded(inputs), want, f"loaded, {case}")
        assert_same_outputs(scoped(inputs), want, f"loaded in the scope, {case}")
    assert attention_kinds(scoped) == attention_kinds(ours)
    # What a plain load holds: this layer, or (where the model's code constructs its
    # attention) Keras's again; either way all of one kind, never a mix.
    kinds = attention_kinds(loaded)
    assert kinds in (attention_kinds(ours), attention_kinds(stock)), kinds
    record_property("loaded_attention", sorted(set(kinds)))


# The families whose attention is their own class, or a subclass of one of Keras's that
# changes what it computes: `{class name: the report's reason}` of the layers it must name.
SUBCLASS = "a subclass of {} that changes what it builds or computes"
DECODER = dict(vocabulary_size=VOCAB, num_layers=1, hidden_dim=16, intermediate_dim=32)


def xlnet():
    return XLNetBackbone(**DECODER, num_heads=2)


def qwen3_5():
    from keras_hub.src.models.qwen3_5.qwen3_5_backbone import Qwen3_5Backbone

    linear = dict(linear_num_key_heads=2, linear_num_value_heads=2)
    return Qwen3_5Backbone(
        **{**DECODER, "num_layers": 2},
        num_query_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        **linear,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )


# (Llama, Mistral, Gemma, GPT-NeoX and the other decoders whose class computes its kernel in
# `_compute_attention`, and Whisper's subclass of keras-hub's cached attention, which changes
# only what it builds, keep their class with the kernel swapped: tests/swap/test_swap_kernels.py.)
REFUSED = {
    # The block's own class name says "Attention": the report names the block.
    "deberta_v3": (
        partial(DebertaV3Backbone, **TEXT),
        {"DisentangledAttentionEncoder": "disentangled"},
    ),
    # Its `XLNetAttentionMaskLayer` makes masks; it is no attention.
    "xlnet": (xlnet, {"TwoStreamRelativeAttention": SUBCLASS.format(MHA)}),
    # Softmax attention whose kernel swap is not built (`families.LEFT`); its other layer type,
    # the gated delta rule, is linear attention and no class of attention by name.
    "qwen3_5": (qwen3_5, {"Qwen3_5Attention": "kernel swap is not built or tested here"}),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_family_with_its_own_attention_is_left_and_named(name):
    build, reasons = REFUSED[name]
    keras.utils.set_random_seed(0)
    model = build()
    kinds = attention_kinds(model)
    inputs = feed(model, PADDING["padding"])
    before = model(inputs)
    report = keras_sdpa.replace_attention(model)
    assert report.swapped == [], report
    assert {kind for _, kind, _ in report.left} == set(reasons), report
    for path, kind, why in report.left:
        assert reasons[kind] in why, (path, why)
        assert path in str(report) and kind in str(report)
    assert attention_kinds(model) == kinds
    assert not any(isinstance(x, ScaledDotProductAttention) for x in model._flatten_layers())
    assert_same_outputs(model(inputs), before)  # left as it was, and still runs
