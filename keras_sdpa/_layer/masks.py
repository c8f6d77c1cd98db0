"""The layer's masks: Keras's padding masks, MHA's attention mask, the causal mask and the
segment ids of a document mask, turned into what the core takes."""

import contextlib

import keras
from keras.src import backend as keras_backend  # the mask accessors have no public name

from keras_sdpa._layer import rank_n
from keras_sdpa._mods import bands, builtin

_RANK_3 = rank_n.Flattener(3, (1,), None, None)  # rank-3 inputs: every step the identity


def as_bool(mask):
    """`mask` as a boolean tensor: True where it is nonzero."""
    mask = keras.ops.convert_to_tensor(mask)
    if keras.backend.standardize_dtype(mask.dtype) != "bool":
        mask = keras.ops.not_equal(mask, keras.ops.zeros((), mask.dtype))
    return mask


def to_core(attention_mask, flat=_RANK_3, num_heads=1):
    """An attention mask in MultiHeadAttention's layout (True or nonzero: may attend) as the
    core takes it, boolean `(B'|1, N|1, T|1, S)`, or None; `flat` the call's
    `rank_n.Flattener` (rank-3 inputs by default: `(T, S)` and `(B, T, S)` gain their
    leading axes, `(B, N|1, T, S)` passes)."""
    if attention_mask is None:
        return None
    return flat.scores(as_bool(attention_mask), num_heads, "attention_mask")


@contextlib.contextmanager
def masks_set_aside(*tensors):
    """Takes the Keras masks off the inputs while the projections run, then puts them back.

    The padding masks reach `call` as arguments; without this the projections,
    which do not support masking, would warn that they drop them. Unlike
    MultiHeadAttention, the caller's tensors keep their masks afterwards.
    """
    masks = [keras_backend.get_keras_mask(tensor) for tensor in tensors]
    for tensor in tensors:
        keras_backend.set_keras_mask(tensor, None)
    try:
        yield
    finally:
        for tensor, mask in zip(tensors, masks):
            if mask is not None:
                keras_backend.set_keras_mask(tensor, mask)


def zero_rows(out, weights, query_mask):
    """Zeroes the attention output `(B, T, N, Hv)` and weights `(B, N, T, S)` of the query
    rows `query_mask` `(B, T)` leaves out, as a row with every key masked has them."""
    if query_mask is None:
        return out, weights
    rows = keras.ops.cast(query_mask, out.dtype)  # (B, T)
    out = out * rows[:, :, None, None]
    if weights is not None:
        weights = weights * keras.ops.cast(query_mask, weights.dtype)[:, None, :, None]
    return out, weights


def empty_rows(mask, query_mask, t, s, causal=False, window=None):
    """`(B|1, N|1, T|1)`: True where a query row may attend to no key, or None where none can.

    `mask` is the keys' side (None, `(T, S)`, `(B, T|1, S)` or `(B, N, T|1, S)`), `query_mask`
    `(B, T)` the rows left out, `causal` MultiHeadAttention's top-left causal mask and `window`
    its band `|t - s| < W`. A padding of the keys alone is counted over each row's band of
    keys (running sums, `(B, S)`), never spread to the `(B, T, S)` mask it stands for, so the
    chunked path keeps its `O(T)` memory.
    """
    banded = causal or window is not None
    may = None  # (B|1, N|1, T|1): whether the row may attend to some key
    if mask is not None:
        mask = to_core(mask)  # (B|1, N|1, T|1, S), as Keras broadcasts
        if banded and mask.shape[2] == 1:
            may = _kept_in_band(mask[:, :, 0], t, s, causal, window)
        elif banded:  # a mask with a query axis: already (B, N|1, T, S) in memory
            band = bands.band(keras.ops.arange(t), keras.ops.arange(s), causal, window)
            may = keras.ops.any(keras.ops.logical_and(mask, band), -1)
        else:
            may = keras.ops.any(mask, -1)
    elif window is not None:
        may = _kept_in_band(keras.ops.ones((1, 1, s), "bool"), t, s, causal, window)
    if query_mask is not None:
        rows = as_bool(query_mask)[:, None, :]  # (B, 1, T)
        may = rows if may is None else keras.ops.logical_and(may, rows)
    return None if may is None else keras.ops.logical_not(may)


def _kept_in_band(kept, t, s, causal, window):
    """`(B, N|1, T)`: whether row `t` keeps a key of its band, `kept` `(B, N|1, S)`, from
    running counts of the kept keys."""
    rows = keras.ops.arange(t)
    last = rows if causal else rows + (window - 1 if window is not None else s)
    first = rows - (window - 1) if window is not None else keras.ops.zeros_like(rows)
    last, first = keras.ops.minimum(last, s - 1), keras.ops.clip(first, 0, s)  # (T,) each
    counts = keras.ops.cumsum(keras.ops.cast(kept, "int32"), axis=-1)  # (B, N|1, S)
    counts = keras.ops.pad(counts, [(0, 0), (0, 0), (1, 0)])  # counts[i]: kept keys before i
    inside = keras.ops.take(counts, last + 1, axis=-1) - keras.ops.take(counts, first, axis=-1)
    return keras.ops.logical_and(inside > 0, last >= first)  # (B, N|1, T)


def uniform_rows(out, empty, mean_values):
    """The attention output `(B, T, N, Hv)` with the rows `empty` marks `(B, 1|N, T|1)`
    replaced by the mean of the values `(B, 1, K, Hv)`: what uniform weights give."""
    heads, kv_heads = out.shape[2], mean_values.shape[2]
    if kv_heads != heads:  # query head n reads key/value head n // (N / K)
        mean_values = keras.ops.repeat(mean_values, heads // kv_heads, axis=2)
    empty = keras.ops.transpose(empty, (0, 2, 1))[..., None]  # (B, T|1, 1|N, 1)
    return keras.ops.where(empty, keras.ops.cast(mean_values, out.dtype), out)


def combine_masks(query_mask, value_mask, key_mask, attention_mask, rank):
    """The boolean mask of `keras.layers.MultiHeadAttention`, in its layout, or None."""
    mask = None
    if query_mask is not None:
        mask = keras.ops.expand_dims(keras.ops.cast(query_mask, "bool"), -1)  # (B, T, 1)
    for padding in (value_mask, key_mask):
        if padding is not None:
            padding = keras.ops.expand_dims(keras.ops.cast(padding, "bool"), -2)  # (B, 1, S)
            mask = padding if mask is None else keras.ops.logical_and(mask, padding)
    if attention_mask is not None:
        attention_mask = as_bool(attention_mask)
        if mask is not None and len(attention_mask.shape) == rank + 1:
            # A per-head attention mask: the padding masks gain the head axis.
            mask = keras.ops.expand_dims(mask, -3)
        mask = attention_mask if mask is None else keras.ops.logical_and(mask, attention_mask)
    return mask


def with_causal(mask, query, value):
    """`mask` (MultiHeadAttention's layout, or None) and MultiHeadAttention's causal mask
    `(1, T, S)`, True where `s <= t`, for rank-3 `query` and `value`."""
    t, s = keras.ops.shape(query)[1], keras.ops.shape(value)[1]
    causal = bands.band(keras.ops.arange(t), keras.ops.arange(s), True, None)[None]  # (1, T, S)
    return causal if mask is None else keras.ops.logical_and(mask, causal)


def bind_segment_ids(mask_mod, segment_ids, query, key, cache):
    """`mask_mod` for this call, holding `segment_ids` where it takes them.

    The ids are gathered inside XLA, which clamps an index out of range, so their sizes
    are checked here where they are known: `(B, T)` with `T` the query's and the key's
    length, or with a cache `(B, S)`, one id per cached position.
    """
    if segment_ids is None:
        return mask_mod
    if mask_mod is None or not builtin.uses_segment_ids(mask_mod):
        raise ValueError(
            "`segment_ids` are read by a `keras_sdpa.mods.document()` mask mod; this "
            f"layer has mask_mod={mask_mod!r}. Received: segment_ids with shape "
            f"{tuple(segment_ids.shape)}"
        )
    segment_ids = keras.ops.convert_to_tensor(segment_ids)
    dtype = keras.backend.standardize_dtype(segment_ids.dtype)
    if len(segment_ids.shape) != 2 or not keras.backend.is_int_dtype(dtype):
        raise ValueError(
            "`segment_ids` must be a (B, T) integer tensor. Received: segment_ids with "
            f"shape {tuple(segment_ids.shape)} and dtype {dtype}"
        )
    if len(query.shape) != 3:
        raise ValueError(
            "`segment_ids` need rank-3 inputs (B, T, E), one sequence per row. "
            f"Received: query.shape={tuple(query.shape)}"
        )
    expected = [("batch size", 0, query.shape[0])]
    if cache is not None:
        shape = keras.ops.convert_to_tensor(cache).shape  # checked whole in `call.cached`
        expected.append(("the cache's length", 1, shape[2] if len(shape) == 5 else None))
    else:
        expected += [
            ("the query's length", 1, query.shape[1]),
            ("the key's length", 1, key.shape[1]),
        ]
    for name, axis, size in expected:
        if None not in (size, segment_ids.shape[axis]) and size != segment_ids.shape[axis]:
            raise ValueError(
                f"`segment_ids` must have {name} {size} (one id per position: (B, T), or "
                "with a cache (B, S)). Received: segment_ids with shape "
                f"{tuple(segment_ids.shape)}"
            )
    return builtin.bind(mask_mod, segment_ids, None)
