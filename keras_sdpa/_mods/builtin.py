"""The built-in mods of `keras_sdpa.mods`: the mask mods and score mods, each a small object
with a config, registered for Keras saving under the package `keras_sdpa` (the names saved
`.keras` files hold). Users import them, and their factories, from `keras_sdpa.mods`.

`check_heads`, `uses_segment_ids` and `bind` ask what a mod is: they are here, beside the
classes they know. The machinery they all share (`Mod`, `split`, `join`, ...) is `_mods/base.py`.
"""

import copy
import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_sdpa import _backend
from keras_sdpa._mods import bands
from keras_sdpa._mods.base import Mod, join, static_key, tensors_of
from keras_sdpa._shared import checks as _checks
from keras_sdpa._shared.types import Tensor

_PACKAGE = "keras_sdpa"


# ----------------------------------------------------------------------------- mask mods


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Causal(Mod):
    """`q_idx >= kv_idx`: each query sees itself and the keys before it."""

    def __call__(self, b, h, q_idx, kv_idx):
        return bands.within(q_idx - kv_idx, True, None)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SlidingWindow(Mod):
    """`|q_idx - kv_idx| < window`: the band of Keras's `MultiHeadAttention(sliding_window=...)`.

    Combine with `causal()` (`and_masks`) for the causal band of Mistral.
    """

    def __init__(self, window):
        self.window = _checks.positive_int("window", window)

    def __call__(self, b, h, q_idx, kv_idx):
        return bands.within(q_idx - kv_idx, False, self.window)

    def get_config(self):
        return {"window": self.window}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ChunkedLocal(Mod):
    """`q_idx // chunk == kv_idx // chunk`: attention within fixed chunks (Llama 4's local layers,
    there also causal: `and_masks(causal(), chunked_local(c))`)."""

    def __init__(self, chunk):
        self.chunk = _checks.positive_int("chunk", chunk)

    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx // self.chunk == kv_idx // self.chunk

    def get_config(self):
        return {"chunk": self.chunk}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PrefixLM(Mod):
    """Prefix-LM (Raffel et al., 2020, T5 section 3.2.1): causal, and every query sees the prefix.

    `kv_idx <= q_idx or kv_idx < prefix_length`. `prefix_length` is an int for every row, or a
    `(B,)` integer tensor, one length per row.
    """

    def __init__(self, prefix_length):
        if isinstance(prefix_length, numbers.Integral) and not isinstance(prefix_length, bool):
            if prefix_length < 0:
                raise ValueError(
                    "`prefix_length` must be a non-negative int or a (B,) integer tensor. "
                    f"Received: prefix_length={prefix_length!r}"
                )
            self.prefix_length = int(prefix_length)
            return
        if prefix_length is not None:
            prefix_length = ops.convert_to_tensor(prefix_length)
            dtype = keras.backend.standardize_dtype(prefix_length.dtype)
            if len(prefix_length.shape) != 1 or "int" not in dtype:
                raise ValueError(
                    "`prefix_length` must be a non-negative int or a (B,) integer tensor. "
                    f"Received: prefix_length with shape {tuple(prefix_length.shape)} and "
                    f"dtype {dtype}"
                )
        self.prefix_length = prefix_length

    def __call__(self, b, h, q_idx, kv_idx):
        prefix = self.prefix_length
        if not isinstance(prefix, int):
            prefix = ops.take(ops.cast(prefix, "int32"), b, axis=0)  # (B, 1, 1, 1)
        return ops.logical_or(kv_idx <= q_idx, kv_idx < prefix)

    def get_config(self):
        if not isinstance(self.prefix_length, int):
            raise ValueError(
                "A `prefix_lm` mod with per-row prefix lengths holds data of one batch and "
                "cannot be saved. Save `prefix_lm(<int>)`. Received: prefix_length with shape "
                f"{tuple(self.prefix_length.shape)}"
            )
        return {"prefix_length": self.prefix_length}

    def _key(self):
        if isinstance(self.prefix_length, int):
            return (type(self), self.prefix_length)
        return (type(self), "per-row")

    def _tensors(self):
        return () if isinstance(self.prefix_length, int) else (self.prefix_length,)

    def _with_tensors(self, tensors):
        if not tensors:
            return self
        new = copy.copy(self)
        (new.prefix_length,) = tensors
        return new


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Document(Mod):
    """Packed sequences: a query sees only the keys of its own segment.

    `segment_ids[b, q_idx] == kv_segment_ids[b, kv_idx]`, with `(B, T)` and `(B, S)` integer
    ids (`kv_segment_ids` defaults to `segment_ids`, for self-attention). Combine with
    `causal()` for packed causal language modelling.

    Built without ids (`document()`), the mod takes them from the layer's call:
    `layer(x, x, segment_ids=ids)`.
    """

    def __init__(self, segment_ids=None, kv_segment_ids=None):
        self.segment_ids = _check_ids("segment_ids", segment_ids)
        self.kv_segment_ids = _check_ids("kv_segment_ids", kv_segment_ids)

    def __call__(self, b, h, q_idx, kv_idx):
        if self.segment_ids is None:
            raise ValueError(
                "The `document` mask needs segment ids: build it as `document(segment_ids)`, "
                "or pass `segment_ids=` to the layer's call. Received: segment_ids=None"
            )
        ids = ops.cast(self.segment_ids, "int32")
        kv_ids = ids if self.kv_segment_ids is None else ops.cast(self.kv_segment_ids, "int32")
        q_seg = _gather_rows(ids, b, q_idx)  # (B, 1, t, 1)
        kv_seg = _gather_rows(kv_ids, b, kv_idx)  # (B, 1, 1, s)
        return ops.equal(q_seg, kv_seg)

    def bind(self, segment_ids, kv_segment_ids=None):
        """This mask with the ids of one call."""
        return Document(segment_ids, kv_segment_ids)

    def _key(self):
        return (type(self), self.segment_ids is None, self.kv_segment_ids is None)

    def _tensors(self):
        return tuple(x for x in (self.segment_ids, self.kv_segment_ids) if x is not None)

    def _with_tensors(self, tensors):
        new, tensors = copy.copy(self), list(tensors)
        for name in ("segment_ids", "kv_segment_ids"):
            if getattr(self, name) is not None:
                setattr(new, name, tensors.pop(0))
        return new


def _check_ids(name, ids):
    if ids is None:
        return None
    ids = ops.convert_to_tensor(ids)
    dtype = keras.backend.standardize_dtype(ids.dtype)
    if len(ids.shape) != 2 or "int" not in dtype:
        raise ValueError(
            f"`{name}` must be a (B, length) integer tensor. Received: {name} with shape "
            f"{tuple(ids.shape)} and dtype {dtype}"
        )
    return ids


def _gather_rows(ids, b, positions):
    """`ids[b, positions]` for broadcastable `b` and `positions`."""
    length = ops.shape(ids)[1]
    return ops.take(ops.reshape(ids, (-1,)), b * length + positions)  # row-major flat index


class Combined(Mod):
    def __init__(self, *mask_mods):
        if not mask_mods:
            raise ValueError(f"`{type(self).__name__}` needs at least one mask mod. Received: none")
        for mod in mask_mods:
            if not callable(mod):
                raise ValueError(
                    f"Every argument of `{type(self).__name__}` must be a mask mod (a callable). "
                    f"Received: {mod!r}"
                )
        self.mask_mods = tuple(mask_mods)

    def __call__(self, b, h, q_idx, kv_idx):
        result = None
        for mod in self.mask_mods:
            allowed = ops.convert_to_tensor(mod(b, h, q_idx, kv_idx))
            result = allowed if result is None else self._op(result, allowed)
        return result

    def bind(self, segment_ids, kv_segment_ids=None):
        return type(self)(*(bind(mod, segment_ids, kv_segment_ids) for mod in self.mask_mods))

    def uses_segment_ids(self):
        return any(uses_segment_ids(mod) for mod in self.mask_mods)

    def get_config(self):
        return {"mask_mods": [keras.saving.serialize_keras_object(m) for m in self.mask_mods]}

    @classmethod
    def from_config(cls, config):
        return cls(*(keras.saving.deserialize_keras_object(m) for m in config["mask_mods"]))

    def _key(self):
        return (type(self), tuple(static_key(mod) for mod in self.mask_mods))

    def _tensors(self):
        return tuple(t for mod in self.mask_mods for t in tensors_of(mod))

    def _with_tensors(self, tensors):
        mods, start = [], 0
        for mod in self.mask_mods:
            count = len(tensors_of(mod))  # a template's are placeholders: counted, not read
            mods.append(join(mod, tensors[start : start + count]))
            start += count
        return type(self)(*mods)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AndMasks(Combined):
    """A key is allowed when every mask mod allows it."""

    _op = staticmethod(ops.logical_and)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class OrMasks(Combined):
    """A key is allowed when any mask mod allows it."""

    _op = staticmethod(ops.logical_or)


# ---------------------------------------------------------------------------- score mods


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SoftCap(Mod):
    """`cap * tanh(score / cap)` (Gemma 2): the logits stay inside `(-cap, cap)`."""

    def __init__(self, cap):
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0:
            raise ValueError(f"`cap` must be a positive number. Received: cap={cap!r}")
        self.cap = float(cap)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * _backend.get().tanh(score / self.cap)  # float64 stays float64

    def get_config(self):
        return {"cap": self.cap}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Alibi(Mod):
    """ALiBi (Press et al., 2022): `score - slope[h] * |q_idx - kv_idx|`.

    The slopes are the paper's geometric sequence, `2^(-8 h' / n)` for `h' = 1..n` when the
    head count `n` is a power of two, interleaved from the next power of two otherwise. With
    a causal mask this is the paper's `slope * (kv_idx - q_idx)`; without one, the distance
    counts both ways.
    """

    def __init__(self, num_heads):
        self.num_heads = _checks.positive_int("num_heads", num_heads)

    def __call__(self, score, b, h, q_idx, kv_idx):
        slopes = ops.convert_to_tensor(alibi_slopes(self.num_heads), score.dtype)
        distance = ops.cast(ops.abs(q_idx - kv_idx), score.dtype)
        return score - ops.take(slopes, h, axis=0) * distance

    def get_config(self):
        return {"num_heads": self.num_heads}


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The `num_heads` ALiBi slopes, a NumPy float64 array."""

    def powers(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return np.array(powers(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = alibi_slopes(2 * closest)[0::2][: num_heads - closest]
    return np.array(powers(closest) + list(extra))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RelativePositionBias(keras.layers.Layer):
    """T5's learned relative-position bias (Raffel et al., 2020): `score + table[bucket, h]`.

    The distance `kv_idx - q_idx` falls into one of `num_buckets` buckets: exact up to half of
    them, logarithmic up to `max_distance`, and the last bucket beyond. `bidirectional` gives
    keys before and after the query their own halves of the buckets (T5's encoder); without it,
    keys after the query share bucket 0 (its decoder). The table, `(num_buckets, num_heads)`,
    is a trainable weight; the attention layer that holds this mod tracks it.

    Args:
        num_heads: the number of query heads `N`.
        num_buckets: the number of buckets. Defaults to 32, as T5.
        max_distance: distances at or beyond it share the last bucket. Defaults to 128.
        bidirectional: whether keys after the query get their own buckets. Defaults to True.
        embeddings_initializer: the table's initializer.
    """

    def __init__(
        self,
        num_heads,
        num_buckets=32,
        max_distance=128,
        bidirectional=True,
        embeddings_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = _checks.positive_int("num_heads", num_heads)
        self.num_buckets = _checks.positive_int("num_buckets", num_buckets)
        self.max_distance = _checks.positive_int("max_distance", max_distance)
        if self.num_buckets < (4 if bidirectional else 2):
            raise ValueError(
                "`num_buckets` must be at least 4 (2 with bidirectional=False). "
                f"Received: num_buckets={num_buckets}"
            )
        self.bidirectional = bool(bidirectional)
        max_exact = (self.num_buckets // 2 if self.bidirectional else self.num_buckets) // 2
        if self.max_distance <= max_exact:
            raise ValueError(
                f"`max_distance` must be above the {max_exact} distances that get exact buckets "
                f"(num_buckets={self.num_buckets}, bidirectional={self.bidirectional}); the "
                f"log buckets span the distances between. Received: max_distance={max_distance}"
            )
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.table = self.add_weight(
            shape=(self.num_buckets, self.num_heads),
            initializer=self.embeddings_initializer,
            name="relative_attention_bias",
        )
        self.built = True

    def call(self, score, b, h, q_idx, kv_idx):
        bucket = relative_position_bucket(
            kv_idx - q_idx, self.bidirectional, self.num_buckets, self.max_distance
        )  # (1, 1, t, s)
        table = ops.cast(ops.convert_to_tensor(self.table), score.dtype)  # (buckets, N)
        # table[bucket, h], by the row-major flat index: (1, N, t, s)
        return score + ops.take(ops.reshape(table, (-1,)), bucket * self.num_heads + h)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "num_buckets": self.num_buckets,
                "max_distance": self.max_distance,
                "bidirectional": self.bidirectional,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            }
        )
        return config


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """T5's bucket of each `kv_idx - q_idx`, an int32 tensor of the same shape."""
    position = ops.cast(relative_position, "int32")
    buckets = ops.zeros_like(position)
    if bidirectional:
        num_buckets //= 2
        buckets += ops.cast(position > 0, "int32") * num_buckets
        position = ops.abs(position)
    else:
        position = -ops.minimum(position, 0)
    max_exact = num_buckets // 2
    is_small = position < max_exact
    ratio = ops.log(ops.cast(ops.maximum(position, 1), "float32") / max_exact)
    large = max_exact + ops.cast(
        ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact), "int32"
    )
    large = ops.minimum(large, num_buckets - 1)
    return buckets + ops.where(is_small, position, large)


# ------------------------------------------------------------- what a mod is, to the core


def check_heads(mod, num_heads, name="score_mod"):
    """Raises when a built-in mod made for a head count (`alibi(n)`,
    `relative_position_bias(n)`) meets `num_heads` query heads: inside XLA its per-head
    gather would clamp the heads past `n` to the last one. (The layer checks its score mod
    itself before its cached calls wrap it for the core.)"""
    if not isinstance(mod, (Alibi, RelativePositionBias)):
        return
    heads = mod.num_heads
    if heads is not None and num_heads is not None and heads != num_heads:
        raise ValueError(
            f"`{name}` was made for {heads} heads and meets {num_heads} query heads. "
            f"Received: {name}={type(mod).__name__}(num_heads={heads}), num_heads={num_heads}"
        )


def uses_segment_ids(mod):
    """Whether `mod` takes segment ids from the layer's call."""
    if isinstance(mod, Combined):
        return mod.uses_segment_ids()
    return isinstance(mod, Document)


def bind(mod, segment_ids, kv_segment_ids):
    if isinstance(mod, (Document, Combined)):
        return mod.bind(segment_ids, kv_segment_ids)
    return mod
