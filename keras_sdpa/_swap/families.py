"""Kernel swaps: a keras-hub family keeps its own attention class, and its kernel runs on the core.

Keras's attention classes are swapped whole for `ScaledDotProductAttention` (`swap.py`). The
decoder families (Llama, Mistral, Gemma, Qwen, Phi-3, ...) write their own attention class:
their projections, rotary embeddings, query/key norms, LoRA and quantized kernels and cache
bookkeeping stay as they are, and only the method that computes
`softmax(scale * Q K^T + masks) V`, `_compute_attention`, runs on
`keras_sdpa.scaled_dot_product_attention`. Every such class reaches it with `(query, key,
value, attention_mask)`: queries `(B, T, N, H)`, keys and values `(B, S, N|K, H)` (repeated to
`N` heads by the family, or grouped), and a `(B, T, S)` mask, True or 1 where allowed.

What differs between families is a row of `FAMILIES`: the scale, whether the stock kernel
narrows the mask to a sliding window (with the family's own `_mask_sliding_window`), the logit
soft cap, the dropout it applies to the weights, and whether the stock kernel is Keras's fused
`ops.dot_product_attention` (on JAX), which gives a fully masked query row the mean of the
values where the core gives zeros. The swap reproduces what the stock kernel computes, the
fused path's choices included, so that the swapped model gives the stock model's outputs.
"""

import dataclasses
import sys
import types
from collections.abc import Callable

import keras
from keras import ops

from keras_sdpa import ops as core
from keras_sdpa._core import request
from keras_sdpa._swap.call_families import CALL_FAMILIES, CallFamily, core_options


def _fused_available(layer):
    """keras-hub's own test: Keras's fused op on JAX and torch (any device), never TensorFlow."""
    from keras_hub.src.utils.keras_utils import fused_attention_op_available

    return fused_attention_op_available()


def _own_fused_test(layer):
    """The class's own `_use_fused_attention_op()` (no dropout, a GPU or TPU)."""
    return layer._use_fused_attention_op()


def _never(layer):
    return False


@dataclasses.dataclass(frozen=True)
class Family:
    """How one attention class's stock kernel computes.

    Attributes:
        scale: the logit scale, from the layer.
        fused: whether the stock kernel runs Keras's fused `ops.dot_product_attention` now.
        window: whether the stock kernel narrows the mask with `layer._mask_sliding_window`
            (on its unfused path only, unless `window_when_fused`).
        window_when_fused: the window applies on the fused path too (Gemma's).
        soft_cap: the logit soft cap, or None.
        dropout: the `keras.layers.Dropout` the stock kernel applies to the weights, or None.
        kernel: the method that replaces the class's `_compute_attention`: the decoders'
            signature, or Keras's `MultiHeadAttention`'s (`_keras_kernel`).
        groups: how many query heads share a key/value head where the class repeats its keys
            and values to the query heads (`ops.repeat`) before its kernel, or 1. The swapped
            kernel takes every `groups`-th head back, which is exactly the class's own keys,
            and the core reads each key/value head once for its group (grouped-query
            attention) instead of `groups` copies.
    """

    scale: Callable[[keras.layers.Layer], float]
    fused: Callable[[keras.layers.Layer], bool] = _never
    window: Callable[[keras.layers.Layer], bool] = _never
    window_when_fused: bool = False
    soft_cap: Callable[[keras.layers.Layer], float | None] = lambda layer: None
    dropout: Callable[[keras.layers.Layer], keras.layers.Dropout | None] = lambda layer: None
    kernel: str = "_compute_attention"
    groups: Callable[[keras.layers.Layer], int] = lambda layer: 1


def _inv_norm(layer):
    return layer._inv_norm_factor


def _gemma_scale(layer):
    width = (
        layer.head_dim
        if layer.query_head_dim_normalize
        else (layer.hidden_dim // layer.num_query_heads)
    )
    return 1.0 / float(width) ** 0.5


def _window_flag(layer):
    """Qwen's and Gemma's switch for the window their kernel applies."""
    return bool(layer.use_sliding_window_attention)


def _qwen3_window(layer):
    return bool(layer.sliding_window_size)


# A subclass of Keras's `MultiHeadAttention` (keras-hub's cached one) that changes only what it
# builds (Whisper's key projection has no bias): Keras's kernel, which runs the fused op (whose
# fully masked rows get uniform weights) unless it drops weights out (its masked softmax gives
# those rows zeros, as the core does).
KERAS_MHA = Family(
    scale=lambda layer: layer._inverse_sqrt_key_dim,
    fused=lambda layer: not layer._dropout,
    dropout=lambda layer: layer._dropout_layer if layer._dropout else None,
    kernel="_keras_kernel",
)


def _groups(layer):
    """The key/value groups of a class that repeats its keys (Mistral names it privately)."""
    groups = getattr(layer, "num_key_value_groups", None)
    return getattr(layer, "_num_key_value_groups", 1) if groups is None else groups


LLAMA_LIKE = Family(scale=_inv_norm, fused=_fused_available, groups=_groups)
QWEN = Family(scale=_inv_norm, fused=_fused_available, window=_window_flag, groups=_groups)
QWEN3 = Family(scale=_inv_norm, fused=_fused_available, window=_qwen3_window, groups=_groups)
GEMMA = Family(
    scale=_gemma_scale,
    fused=_own_fused_test,
    window=_window_flag,
    window_when_fused=True,
    soft_cap=lambda layer: layer.logit_soft_cap,
    dropout=lambda layer: layer.dropout_layer if layer.dropout else None,
)

# The classes by their module and name (imported only when a model holds one).
_MODELS = "keras_hub.src.models"
FAMILIES = types.MappingProxyType(
    {
        f"{_MODELS}.llama.llama_attention.LlamaAttention": LLAMA_LIKE,
        f"{_MODELS}.mistral.mistral_attention.CachedMistralAttention": LLAMA_LIKE,
        f"{_MODELS}.mixtral.mixtral_attention.CachedMixtralAttention": dataclasses.replace(
            LLAMA_LIKE, fused=_own_fused_test
        ),
        f"{_MODELS}.phi3.phi3_attention.Phi3Attention": LLAMA_LIKE,
        f"{_MODELS}.qwen.qwen_attention.QwenAttention": QWEN,
        f"{_MODELS}.qwen_moe.qwen_moe_attention.QwenMoeAttention": dataclasses.replace(
            QWEN, fused=_own_fused_test
        ),
        f"{_MODELS}.qwen3.qwen3_attention.Qwen3Attention": QWEN3,
        f"{_MODELS}.qwen3_moe.qwen3_moe_attention.Qwen3MoeAttention": QWEN3,
        f"{_MODELS}.smollm3.smollm3_layers.SmolLM3Attention": LLAMA_LIKE,
        f"{_MODELS}.gpt_neo_x.gpt_neo_x_attention.GPTNeoXAttention": Family(
            scale=_inv_norm,
            fused=lambda layer: _fused_available(layer) and layer.dropout == 0,
            dropout=lambda layer: layer._attn_dropout_layer if layer.dropout else None,
        ),
        f"{_MODELS}.gemma.gemma_attention.CachedGemmaAttention": GEMMA,
        f"{_MODELS}.gemma3.gemma3_attention.CachedGemma3Attention": GEMMA,
        f"{_MODELS}.whisper.whisper_cached_multi_head_attention."
        "WhisperCachedMultiHeadAttention": KERAS_MHA,
    }
)


# keras-hub 0.32's classes whose attention is the core's softmax but whose kernel swap is not
# built (nor tested) here; each differs from the families above in how it hands its kernel
# the scores' inputs (read from keras-hub's sources).
_NOT_BUILT = "computes softmax attention, but its kernel swap is not built or tested here"

# Attention classes left as they are, by class name, with the reason the report gives.
LEFT = types.MappingProxyType(
    {
        "DisentangledAttentionEncoder": "DeBERTa-v3's disentangled attention adds content-to-"
        "position and position-to-content scores, which the core does not compute",
        "GptOssAttention": "its attention sinks (a learned logit per head that takes weight but "
        "no value), which the core does not take",
        "DFineMultiscaleDeformableAttention": "D-FINE's deformable attention samples values at "
        "learned offsets around reference points: it has no query-key scores",
        "Gemma3nAudioConformerAttention": "Gemma 3n's audio attention runs on local blocks with "
        "relative-position logits and a learned per-dimension query scale, which the core "
        "does not compute",
        "Gemma3nTextAttention": f"{_NOT_BUILT} (scale 1, its kernel works heads first and "
        "returns its weights)",
        "Gemma4TextAttention": f"{_NOT_BUILT} (scale 1, a soft cap, its own fused-path test)",
        "Gemma4VisionAttention": f"{_NOT_BUILT} (scale 1, a soft cap)",
        "Qwen3_5Attention": f"{_NOT_BUILT} (Qwen 3's kernel, with an output gate after it)",
        "T5GemmaAttention": f"{_NOT_BUILT} (its mask arrives as an additive bias)",
        "T5Gemma2Attention": f"{_NOT_BUILT} (its mask arrives as an additive bias)",
        "T5Gemma2MergedAttention": f"{_NOT_BUILT} (one softmax over the self- and "
        "cross-attention keys together, its mask an additive bias)",
        "DFineMultiheadAttention": f"{_NOT_BUILT} (inside its `call`, with a float mask, "
        "returning its weights)",
        "EsmSelfAttention": f"{_NOT_BUILT} (inside its `call`; outside torch its padding mask "
        "masks query rows, not keys)",
        "RoformerAttention": f"{_NOT_BUILT} (inside its `call`; outside torch its padding mask "
        "masks query rows, not keys)",
        "MobileAttention": f"{_NOT_BUILT} (MobileNetV5's multi-query or 2-D attention over "
        "convolutional feature maps, inside its `call`)",
    }
)


def loaded_classes():
    """The `FAMILIES` and `CALL_FAMILIES` classes whose modules are imported (keras-hub imports
    its models when it is imported itself)."""
    classes = []
    for path in (*FAMILIES, *CALL_FAMILIES):
        module, name = path.rsplit(".", 1)
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            classes.append(cls)
    return classes


def family_of(layer):
    """The `Family` or `CallFamily` of `layer`'s exact class, or None."""
    cls = type(layer)
    path = f"{cls.__module__}.{cls.__qualname__}"
    return FAMILIES.get(path) or CALL_FAMILIES.get(path)


def options(flash_attention, layer_options):
    """The core's `implementation` and `chunk_size` for a kernel swap; the other layer
    options are the swapped layer's own and are refused there."""
    others = sorted(set(layer_options) - {"implementation", "chunk_size"})
    if others:
        raise ValueError(
            "A kernel-swapped attention class (Llama's, Gemma's, ...) keeps its own settings; "
            "only `flash_attention`, `implementation` and `chunk_size` reach its kernel. "
            f"Received: {', '.join(others)}"
        )
    implementation = {True: "chunked", False: "dense"}.get(flash_attention, "auto")
    return {
        "implementation": layer_options.get("implementation", implementation),
        "chunk_size": layer_options.get("chunk_size"),
    }


def why_left(layer):
    """Why a family's layer keeps its stock kernel, or None: settings the class accepts and
    the core refuses (Gemma's `logit_soft_cap=0.0`, which makes every stock logit `0 *
    tanh(s / 0)`: 0, or NaN where `s` is 0), checked as the core checks a call."""
    family = family_of(layer)
    if isinstance(family, CallFamily):
        return None
    try:
        scale = family.scale(layer)
    except AttributeError:  # set in `build` (Llama's), unknown to a scope at construction
        scale = None
    try:
        request.Request(scale=scale, attn_logits_soft_cap=family.soft_cap(layer))
    except ValueError as error:
        return f"its settings are outside what the core computes: {error}"
    return None


def swap(layer, implementation="auto", chunk_size=None):
    """Runs `layer`'s kernel on the core from now on: `_compute_attention`, on this instance,
    on the core's `implementation` (`replace_attention`'s `flash_attention`)."""
    layer._sdpa_core_options = (implementation, chunk_size)
    family = family_of(layer)
    if isinstance(family, CallFamily):
        layer.call = types.MethodType(family.call, layer)
    else:
        layer._compute_attention = types.MethodType(_KERNELS[family.kernel], layer)


def is_swapped(layer):
    methods = (layer.__dict__.get(name) for name in ("_compute_attention", "call"))
    swapped = {*_KERNELS.values(), *(family.call for family in CALL_FAMILIES.values())}
    return any(getattr(method, "__func__", None) in swapped for method in methods)


def _compute_attention(
    self, query, key, value, attention_mask=None, training=False, cache_update_index=0, **kwargs
):
    """The stock kernel's result, computed by `keras_sdpa.scaled_dot_product_attention`."""
    family = family_of(self)
    fused = family.fused(self)
    mask = attention_mask
    if mask is not None and family.window(self) and (not fused or family.window_when_fused):
        index = 0 if cache_update_index is None else cache_update_index
        mask = self._mask_sliding_window(mask, cache_update_index=index)
    groups = family.groups(self)
    if groups > 1 and key.shape[2] == query.shape[2]:  # repeated by the class: one copy each
        key, value = _first_copies(key, groups), _first_copies(value, groups)
    return _on_core(self, family, query, key, value, mask, training, fused=fused)


def _first_copies(x, groups):
    """`(B, S, N, H)` keys repeated `groups` times each (`ops.repeat(.., axis=2)`) to the
    `(B, S, N // groups, H)` keys they repeat: a reshape and a contiguous slice (a strided
    slice took 4x its time in TensorFlow's graph mode)."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], shape[2] // groups, groups, shape[3]))[:, :, :, 0]


def _keras_kernel(
    self,
    query,
    key,
    value,
    attention_mask=None,
    training=None,
    return_attention_scores=False,
    use_causal_mask=False,
):
    """Keras's `MultiHeadAttention._compute_attention` on the core: `(output, None)`. The
    stock kernel still runs where the weights are asked for or the attention axes are not
    Keras's default (queries not `(B, T, N, H)`)."""
    if return_attention_scores or len(query.shape) != 4:
        stock = type(self)._compute_attention
        return stock(
            self,
            query,
            key,
            value,
            attention_mask,
            training,
            return_attention_scores,
            use_causal_mask,
        )
    mask, is_causal = attention_mask, bool(use_causal_mask)
    if is_causal and mask is not None:  # one mask, so that its fully masked rows are known
        mask = ops.logical_and(ops.cast(mask, "bool"), self._compute_causal_mask(query, value))
        is_causal = False
    family = family_of(self)
    out = _on_core(self, family, query, key, value, mask, training, family.fused(self), is_causal)
    return out, None


def _on_core(self, family, query, key, value, mask, training, fused, is_causal=False):
    """The core's `softmax(scale * Q K^T + masks) V` with the family's scale, soft cap and
    dropout, and with `fused`, the fused op's fully masked rows."""
    if mask is not None:
        mask = ops.cast(mask, "bool")
        while len(mask.shape) < 4:  # (T, S) or (B, T, S) to (B|1, 1, T, S)
            mask = ops.expand_dims(mask, -3)
    out = core.scaled_dot_product_attention(
        query,
        key,
        value,
        mask,
        is_causal=is_causal,
        scale=family.scale(self),
        attn_logits_soft_cap=family.soft_cap(self),
        **core_options(self, family.dropout(self), training),
    )  # (B, T, N, H)
    if fused and mask is not None:
        out = _fused_rows(out, value, mask)
    return out


_KERNELS = types.MappingProxyType(
    {"_compute_attention": _compute_attention, "_keras_kernel": _keras_kernel}
)


def _fused_rows(out, value, mask):
    """Keras's fused op (XLA's implementation) gives a fully masked query row uniform
    weights, the mean of the values, where the core gives zeros."""
    heads, kv_heads = ops.shape(out)[2], ops.shape(value)[2]
    mean = ops.mean(value, axis=1, keepdims=True)  # (B, 1, K, H)
    if heads != kv_heads:
        mean = ops.repeat(mean, heads // kv_heads, axis=2)  # (B, 1, N, H)
    rows = ops.transpose(ops.any(mask, axis=-1), (0, 2, 1))[..., None]  # (B, T, 1, 1)
    return ops.where(rows, out, ops.cast(mean, out.dtype))
