"""Programmable attention: built-in `score_mod` and `mask_mod` functions.

The core (`keras_sdpa.scaled_dot_product_attention`) and the layer take two user functions,
in the argument order of PyTorch's FlexAttention (`torch.nn.attention.flex_attention`):

    score_mod(score, b, h, q_idx, kv_idx) -> score     changes a logit
    mask_mod(b, h, q_idx, kv_idx) -> bool             True: query `q_idx` may see key `kv_idx`

They are traced into the XLA program, forward and gradient, on both paths. They are called on
broadcastable int32 index tensors in the `(B, N, T, S)` layout of the logits:

    score  (B, N, t, s) float32      b (B, 1, 1, 1)      h (1, N, 1, 1)
    q_idx  (1, 1, t, 1)              kv_idx (1, 1, 1, s)

On the dense path `t = T` and `s = S`; on the chunked path `t` and `s` are one block's, and
the indices are the block's absolute positions. So a function written with elementwise ops,
`keras.ops` (`where`, `take` on the indices), works on both paths and both backends (on
TensorFlow, `tf` ops too).
A mod must not reduce across positions (a sum or a max over `q_idx` or `kv_idx`): on the
chunked path it sees one block at a time. Positions past the end of a sequence (the padding
of the last block) are clamped to the last position; the core masks them anyway.

`h` is the query head. Under grouped-query attention (`K` key heads for `N` query heads),
query head `h` reads key head `h // (N // K)`.

Every mod here is a small object with `get_config()` and `from_config()`, registered for Keras
saving, so a layer that holds one round-trips through `.keras` files. The one that learns,
`relative_position_bias`, is a Keras layer that owns its table; the layer that holds it
tracks the table as one of its weights.

Example:

>>> from keras_sdpa import mods
>>> q = keras.random.normal((2, 6, 4, 8))  # (B, T, N, H)
>>> out = scaled_dot_product_attention(
...     q, q, q, score_mod=mods.alibi(4),
...     mask_mod=mods.and_masks(mods.causal(), mods.sliding_window(3)),
... )
>>> tuple(out.shape)
(2, 6, 4, 8)
"""

# The public API: the user's names only. The classes live in the mods' room, `keras_sdpa/_mods/`:
# `builtin.py`, the built-in mods; `base.py`, the `Mod` base and how the core handles a mod
# (`split`, `join`, `variables_of`, ...: the rooms above import those from there). Imported in
# the order the API reference renders them (`::: keras_sdpa.mods` in docs/api.md orders
# re-exported names by their import), so isort leaves this block as written.
# isort: off
from keras_sdpa._mods.base import Mod
from keras_sdpa._mods.builtin import (
    Causal,
    SlidingWindow,
    ChunkedLocal,
    PrefixLM,
    Document,
    AndMasks,
    OrMasks,
    SoftCap,
    Alibi,
    RelativePositionBias,
)
from keras_sdpa._mods.base import WithTensors
from keras_sdpa._mods.builtin import alibi_slopes, relative_position_bucket
# isort: on

from collections.abc import Callable  # noqa: E402 (after the API block above)

from keras_sdpa._mods.builtin import Combined
from keras_sdpa._shared.types import MaskMod, Tensor

# What `from keras_sdpa.mods import *` gives and what the API reference renders
# (`::: keras_sdpa.mods` in docs/api.md): a re-exported name is rendered only when listed here.
__all__ = [
    "Mod",
    "Causal",
    "SlidingWindow",
    "ChunkedLocal",
    "PrefixLM",
    "Document",
    "AndMasks",
    "OrMasks",
    "SoftCap",
    "Alibi",
    "RelativePositionBias",
    "WithTensors",
    "alibi_slopes",
    "relative_position_bucket",
    "causal",
    "sliding_window",
    "chunked_local",
    "prefix_lm",
    "document",
    "and_masks",
    "or_masks",
    "with_tensors",
    "soft_cap",
    "alibi",
    "relative_position_bias",
]

# The classes name this module as theirs, where users import them, as before the split: a
# saved config's "module", a repr, a pickle and the compiled program's key (`_core/plan.py`) read
# `keras_sdpa.mods.<class>`. (Loading finds a class by its registered name, `keras_sdpa>Causal`,
# which the split does not change.)
for _class in (
    Mod,
    Causal,
    SlidingWindow,
    ChunkedLocal,
    PrefixLM,
    Document,
    Combined,
    AndMasks,
    OrMasks,
    SoftCap,
    Alibi,
    RelativePositionBias,
    WithTensors,
):
    _class.__module__ = __name__
del _class


# ------------------------------------------------------------------------- the factories


def causal() -> Causal:
    """The causal mask mod: `q_idx >= kv_idx`."""
    return Causal()


def sliding_window(window: int) -> SlidingWindow:
    """The symmetric window `|q_idx - kv_idx| < window`, as Keras's `sliding_window`."""
    return SlidingWindow(window)


def chunked_local(chunk: int) -> ChunkedLocal:
    """Attention within fixed chunks of `chunk` positions."""
    return ChunkedLocal(chunk)


def prefix_lm(prefix_length: int | Tensor) -> PrefixLM:
    """Causal, with a bidirectional prefix of `prefix_length` (an int or a `(B,)` tensor)."""
    return PrefixLM(prefix_length)


def document(segment_ids: Tensor | None = None, kv_segment_ids: Tensor | None = None) -> Document:
    """Packed documents: queries see the keys of their own segment (`(B, T)` ids)."""
    return Document(segment_ids, kv_segment_ids)


def and_masks(*mask_mods: MaskMod) -> AndMasks:
    """A mask mod that allows a key when every one of `mask_mods` allows it."""
    return AndMasks(*mask_mods)


def or_masks(*mask_mods: MaskMod) -> OrMasks:
    """A mask mod that allows a key when any of `mask_mods` allows it."""
    return OrMasks(*mask_mods)


def with_tensors(fn: Callable[..., Tensor], *tensors: Tensor) -> WithTensors:
    """The score mod `fn(score, b, h, q_idx, kv_idx, *tensors)`, whose tensors get gradients."""
    return WithTensors(fn, *tensors)


def soft_cap(cap: float) -> SoftCap:
    """The score mod `cap * tanh(score / cap)`."""
    return SoftCap(cap)


def alibi(num_heads: int) -> Alibi:
    """The ALiBi score mod for `num_heads` heads."""
    return Alibi(num_heads)


def relative_position_bias(
    num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> RelativePositionBias:
    """T5's learned relative-position bias, a layer owning a `(num_buckets, num_heads)` table."""
    return RelativePositionBias(num_heads, num_buckets, max_distance, bidirectional)
