"""The key/value cache of generation: its checks, its per-row write, and the masks and mods
of a query block that starts at a position in it.

`cache` is `(B, 2, S, K, H)`: the projected keys and values of `S` positions, keras-hub's
`CachedMultiHeadAttention` layout. Query `i` of row `b` sits at position `index[b] + i`: a
causal mask, a window and the mods count from there (bottom-right alignment), so keys past a
row's position are never read.

The layer projects and writes (`check`, `update`), then attends here (`attend_from_offsets`).
"""

import keras
import numpy as np

from keras_sdpa import _backend, mods
from keras_sdpa._core import program
from keras_sdpa._layer import masks as _layer_masks
from keras_sdpa._mods import bands, builtin
from keras_sdpa._mods import base as mod_base


def check(cache, index, query, value_mask, key_mask, kv_heads, key_dim, value_dim):
    """`cache` as a tensor, after the checks of a cached call; `ValueError` otherwise."""
    if cache is None:
        raise ValueError(
            "`cache_update_index` needs a `cache`. Received: cache=None, "
            f"cache_update_index={index!r}"
        )
    if len(query.shape) != 3:
        raise ValueError(
            f"A `cache` needs rank-3 inputs (B, T, E). Received: query.shape={tuple(query.shape)}"
        )
    if value_mask is not None or key_mask is not None:
        raise ValueError(
            "Padding masks of the new keys cannot mark the cache; pass `attention_mask` "
            "(B, T, S) over the cached positions instead. Received: a value or key mask "
            "with a cache"
        )
    if value_dim != key_dim:
        raise ValueError(
            "A `cache` stacks keys and values, so `value_dim` must equal `key_dim`. "
            f"Received: key_dim={key_dim}, value_dim={value_dim}"
        )
    cache = keras.ops.convert_to_tensor(cache)
    want = (2, kv_heads, key_dim)
    if len(cache.shape) != 5 or tuple(cache.shape[i] for i in (1, 3, 4)) != want:
        raise ValueError(
            "`cache` must be (B, 2, S, K, H) with K = num_key_value_heads = "
            f"{kv_heads} and H = key_dim = {key_dim}. "
            f"Received: cache.shape={tuple(cache.shape)}"
        )
    return cache


def update(cache, index, key, new_keys_and_values):
    """The keys and values to attend to, each `(B, S, K, H)`, the queries' offsets `(B,)`
    and the cache after the write.

    Without `index` the cache is read as it is, and the queries start at 0. With it,
    `new_keys_and_values()` (called only then) gives the `(B, t, K, H)` keys and values of
    the key input `key` `(B, t, E)`, which are written at `index` (an int for every row, or
    a `(B,)` tensor, one per row): the room is checked for their `t` positions, as
    keras-hub writes them (a cross-attention cache is filled with all the encoder's keys at
    once, whatever the decoder's length).
    """
    offset = keras.ops.zeros(keras.ops.shape(key)[:1], "int32")  # (B,): where queries start
    if index is not None:
        offset = check_index(index, key, cache.shape[2])
        new_keys, new_values = (keras.ops.cast(x, cache.dtype) for x in new_keys_and_values())
        cache = write_rows(cache, keras.ops.stack([new_keys, new_values], axis=1), offset)
    return cache[:, 0], cache[:, 1], offset, cache


def attend_from_offsets(
    q, keys, values, offset, attention_mask, attention_bias, use_causal_mask, request
):
    """The core on the projected queries `q` `(B, T, N, H)` against the cached `keys` and
    `values` `(B, S, K, H)`, the queries starting at `offset` `(B,)`: the causal mask, the
    window and the mods of `request` (the layer's `Request` for this call) count
    from there.

    With `training` and a `dropout`, the attention weights are dropped as in the uncached
    call (keras-hub's too). Returns the attention output `(B, T, N, H)`, the weights (or
    None) and the mask as the core took it.
    """
    # The core sees the score mod only inside the positioned wrapper, whose head count it
    # cannot read: checked here, for a score mod set after the layer was made too.
    builtin.check_heads(request.score_mod, q.shape[2])
    positioned = Positioned(
        offset,
        bool(use_causal_mask),
        request.sliding_window,
        request.mask_mod,
        request.score_mod,
    )
    mask = _layer_masks.to_core(attention_mask)  # (B|1, N|1, T|1, S)
    # The bias in its own precision: the core adds it to float32 logits under mixed precision.
    bias = None if attention_bias is None else keras.ops.convert_to_tensor(attention_bias)
    request = request.replace(
        # One new token against the cache: the core's decode path reads the cache in its
        # (B, S, K, H) layout, where the others would transpose a copy of it every token.
        cached=True,
        is_causal=False,  # counted from each row's position, in the positioned mods
        sliding_window=None,
        score_mod=positioned.score_mod(),
        mask_mod=positioned.mask_mod(),
    )
    result = program.run_request(
        q,
        keras.ops.cast(keys, q.dtype),
        keras.ops.cast(values, q.dtype),
        mask,
        bias,
        request,
    )
    out, weights = result if request.return_weights else (result, None)
    return out, weights, mask


def check_index(index, new, size):
    """`cache_update_index` as a `(B,)` int32 tensor for the new positions `new` `(B, t, E)`
    (the key input), checked where its
    value is known: while tracing when it is static (an int, an eager tensor, a constant of the
    graph), else when the graph runs."""
    # An int, a NumPy value or a list of ints is known here; inside `jax.jit` its tensor
    # would be a tracer, whose value is unknown until the program runs.
    known = None
    if isinstance(index, (int, np.integer, np.ndarray, list, tuple)):
        known = np.asarray(index)
        if known.dtype.kind not in "iu":
            known = None  # the checks below name what is wrong
    index = keras.ops.convert_to_tensor(index)
    dtype = keras.backend.standardize_dtype(index.dtype)
    if not keras.backend.is_int_dtype(dtype) or len(index.shape) not in (0, 1):
        raise ValueError(
            "`cache_update_index` must be an int, or an integer scalar or (B,) tensor. "
            f"Received: cache_update_index with shape {tuple(index.shape)} and dtype {dtype}"
        )
    rows, length = new.shape[0], new.shape[1]
    if len(index.shape) == 1 and None not in (rows, index.shape[0]) and index.shape[0] != rows:
        raise ValueError(
            f"`cache_update_index` must have one position per row of the batch ({rows}). "
            f"Received: cache_update_index with shape {tuple(index.shape)}"
        )
    count = "" if length is None else f"{length} "
    room = f"must leave room for the {count}new positions in a cache of {size}"
    shims = _backend.get()
    values = known if known is not None else shims.static_value(index)  # before the cast
    if values is not None:
        values = np.asarray(values)
        last = np.iinfo("int32").max if size is None else size - (length or 0)
        if values.size and (values.min() < 0 or values.max() > last):
            rule = (
                f"{room}: each row's index in [0, {last}]"
                if None not in (length, size)
                else f"must be a position in [0, {last}]"
            )
            raise ValueError(
                f"`cache_update_index` {rule}. Received: cache_update_index={values.tolist()}"
            )
    index = keras.ops.cast(index, "int32")
    if size is not None and (values is None or length is None):
        # Otherwise the values are known only when the program runs: a TensorFlow graph
        # raises there, while inside an XLA program (where asserts are dropped, and under
        # JAX's jit) a write past the end is lost.
        last = size - keras.ops.shape(new)[1]
        index = shims.checked_in_range(index, last, f"`cache_update_index` {room}")
    if len(index.shape) == 0:
        index = keras.ops.broadcast_to(index, keras.ops.shape(new)[:1])  # (B,)
    return index


def write_rows(cache, update, offset):
    """`cache[b, :, offset[b] : offset[b] + t] = update[b]` for each row, in one scatter:
    `cache (B, 2, S, K, H)`, `update (B, 2, t, K, H)`. Inside a compiled generate loop XLA
    writes it in place; splitting the keys and values and stacking them again copied the
    whole cache on every token."""
    batch, _, length = keras.ops.shape(update)[:3]
    grid = (batch, 2, length)
    rows = keras.ops.broadcast_to(keras.ops.arange(batch)[:, None, None], grid)
    halves = keras.ops.broadcast_to(keras.ops.arange(2)[None, :, None], grid)
    positions = keras.ops.broadcast_to(
        offset[:, None, None] + keras.ops.arange(length)[None, None], grid
    )
    # A position outside the cache (known only when the program runs) is dropped on both
    # backends: JAX's scatter would wrap a negative one to the end, NumPy-style, so it goes
    # past the end instead, where both drop it.
    positions = keras.ops.where(positions < 0, keras.ops.shape(cache)[2], positions)
    # One row of indices per written (K, H) slice: JAX's scatter reads them as (M, 3).
    indices = keras.ops.reshape(keras.ops.stack([rows, halves, positions], -1), (-1, 3))
    updates = keras.ops.reshape(update, (-1, *update.shape[3:]))  # (B 2 t, K, H)
    return keras.ops.scatter_update(cache, indices, updates)


class Positioned(mods.Mod):
    """The layer's masks and mods for a query block that starts at `offset[b]` in a cache.

    Causal: `kv_idx <= offset[b] + q_idx`; the window: `|offset[b] + q_idx - kv_idx| < W`;
    the layer's `mask_mod` and `score_mod` get `q_idx` shifted the same way. The offsets are
    a tensor of the call, so a new position does not trace a new program.
    """

    def __init__(self, offset, causal, window, inner_mask, inner_score):
        self.offset, self.causal, self.window = offset, causal, window
        self.inner_mask, self.inner_score = inner_mask, inner_score

    def mask_mod(self):
        if not (self.causal or self.window or self.inner_mask):
            return None
        return PositionedMask(self.offset, self.causal, self.window, self.inner_mask, None)

    def score_mod(self):
        if self.inner_score is None:
            return None
        return PositionedScore(self.offset, None, None, None, self.inner_score)

    def _position(self, b, q_idx):
        return q_idx + keras.ops.take(keras.ops.cast(self.offset, "int32"), b, axis=0)

    def _key(self):
        return (
            type(self),
            self.causal,
            self.window,
            mod_base.static_key(self.inner_mask),
            mod_base.static_key(self.inner_score),
        )

    def _tensors(self):
        return (self.offset,) + tuple(mod_base.tensors_of(self.inner_mask))

    def _with_tensors(self, tensors):
        inner = mod_base.join(self.inner_mask, tuple(tensors[1:]))  # a template's too: no reads
        return type(self)(tensors[0], self.causal, self.window, inner, self.inner_score)


class PositionedMask(Positioned):
    def __call__(self, b, h, q_idx, kv_idx):
        position = self._position(b, q_idx)
        offset = position - kv_idx  # (B, 1, t, s)
        allowed = bands.within(offset, self.causal, self.window)
        if allowed is None:
            allowed = keras.ops.ones_like(offset, dtype="bool")
        if self.inner_mask is not None:
            inner = self.inner_mask(b, h, position, kv_idx)
            allowed = keras.ops.logical_and(allowed, inner)
        return allowed


class PositionedScore(Positioned):
    def __call__(self, score, b, h, q_idx, kv_idx):
        return mod_base.as_function(self.inner_score)(score, b, h, self._position(b, q_idx), kv_idx)

    def _key(self):
        return (type(self), mod_base.static_key(self.inner_score))

    def _tensors(self):
        return (self.offset,) + tuple(mod_base.tensors_of(self.inner_score))

    def _with_tensors(self, tensors):
        inner = mod_base.join(self.inner_score, tuple(tensors[1:]))  # a template's too: no reads
        return PositionedScore(tensors[0], None, None, None, inner)
