"""The causal band and the sliding window: which keys a query may see by position.

Every causal mask and window of the package is `within`: the core's paths (`band`), the cache's
positioned mask, the layer's masks and the mods `causal()` and `sliding_window(w)`.
"""

from keras import ops


def band(queries, keys, is_causal, window):
    """The causal and window constraints, `(len(queries), len(keys))`, or None.

    Causal: key `s` is allowed for query `t` when `s <= t` (aligned at the top
    left when `T != S`, as in Keras). Window: when `|t - s| < window`, the
    symmetric band of `keras.layers.MultiHeadAttention(sliding_window=...)`;
    with causal, the causal band of Mistral.
    """
    if not is_causal and window is None:
        return None
    return within(queries[:, None] - keys[None, :], is_causal, window)  # (Tq, Sk)


def within(offset, is_causal, window):
    """Whether `offset = q_idx - kv_idx` lies in the causal band (`offset >= 0`) and the
    window (`|offset| < window`), booleans of `offset`'s shape; None with neither. Every
    causal mask and window of the package is this one: the paths' (`band`), the cache's
    positioned mask, the layer's and the mods `causal()` and `sliding_window(w)`."""
    allowed = None
    if is_causal:
        allowed = offset >= 0
    if window is not None:
        near = ops.abs(offset) < window
        allowed = near if allowed is None else ops.logical_and(allowed, near)
    return allowed
