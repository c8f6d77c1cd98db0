"""The core's argument checks: each raises a `ValueError` that names the argument and the value
received, before anything is traced; and the conversions they share (masks to booleans, a seed
to the `(2,)` int32 tensor the dropout draws from)."""

import math
import numbers

import keras
from keras import ops

from keras_sdpa import _backend


def positive_int(name, value, or_none=False):
    """`value` as an int, or a `ValueError` naming `name` unless it is a positive integer
    (or, with `or_none`, None)."""
    if value is None and or_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        expected = "None or a positive int" if or_none else "a positive int"
        raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")
    return int(value)


def check_sliding_window(sliding_window):
    positive_int("sliding_window", sliding_window, or_none=True)


def check_soft_cap(attn_logits_soft_cap):
    cap = attn_logits_soft_cap
    if cap is not None and (
        isinstance(cap, bool)
        or not isinstance(cap, numbers.Real)
        or not math.isfinite(cap)
        or cap <= 0
    ):
        raise ValueError(
            "`attn_logits_soft_cap` must be None or a positive finite number. "
            f"Received: attn_logits_soft_cap={cap!r}"
        )


def check_mod(name, mod):
    if mod is not None and not callable(mod):
        arguments = "(b, h, q_idx, kv_idx)"
        if name == "score_mod":
            arguments = "(score, b, h, q_idx, kv_idx)"
        raise ValueError(
            f"`{name}` must be None or a callable {arguments}. Received: {name}={mod!r}"
        )


def check_scale(scale):
    if (
        isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(
            f"`scale` must be a positive finite number or None. Received: scale={scale!r}"
        )


def check_inputs(query, key, value):
    for name, tensor, layout in (
        ("query", query, "(B, T, N, H)"),
        ("key", key, "(B, S, K, H)"),
        ("value", value, "(B, S, K, Hv)"),
    ):
        if len(tensor.shape) != 4:
            raise ValueError(
                f"`{name}` must have rank 4, {layout}. Received: {name}.shape={tuple(tensor.shape)}"
            )
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if not keras.backend.is_float_dtype(dtype):
            raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={dtype}")
        if tensor.shape[2] is None:
            raise ValueError(
                f"The number of heads of `{name}` (axis 2) must be known when the program is "
                f"traced. Received: {name}.shape={tuple(tensor.shape)}"
            )
    if not _compatible(query.shape[-1], key.shape[-1]):
        raise ValueError(
            "`query` and `key` must have the same head size H (last axis). "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if not _compatible(key.shape[1], value.shape[1]):
        raise ValueError(
            "`key` and `value` must have the same length S (axis 1). "
            f"Received: key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )
    sizes = [query.shape[0], key.shape[0], value.shape[0]]
    if len({size for size in sizes if size is not None}) > 1:
        raise ValueError(
            "`query`, `key` and `value` must have the same batch size B (axis 0). "
            f"Received: query.shape={tuple(query.shape)}, "
            f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )
    if key.shape[2] != value.shape[2]:
        raise ValueError(
            "`key` and `value` must have the same number of heads K (axis 2). "
            f"Received: key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            "The key/value heads K (axis 2 of `key`) must divide the query heads N "
            f"(axis 2 of `query`). Received: query.shape={tuple(query.shape)}, "
            f"key.shape={tuple(key.shape)}"
        )


def check_mask(mask, query, key):
    mask, pattern = _broadcastable("mask", mask, query, key)
    if keras.backend.standardize_dtype(mask.dtype) != "bool":
        mask = ops.not_equal(mask, ops.zeros((), mask.dtype))
    return mask, pattern


def check_bias(bias, query, key):
    bias = ops.convert_to_tensor(bias)
    dtype = keras.backend.standardize_dtype(bias.dtype)
    if not keras.backend.is_float_dtype(dtype):
        raise ValueError(f"`bias` must be a floating tensor. Received: bias.dtype={dtype}")
    return _broadcastable("bias", bias, query, key)


def _broadcastable(name, x, query, key):
    """`x` as a rank-4 tensor that broadcasts to `(B, N, T, S)`, and its pattern.

    The pattern says, for each of `(B, N, T, S)`, whether `x` is full along it
    (True) or broadcasts from size 1 (False). An axis of unknown size is made full.
    """
    target = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])  # (B, N, T, S)
    rank = len(x.shape)
    ok = rank <= 4
    if ok:
        for size, want in zip(reversed(x.shape), reversed(target)):
            if size not in (None, 1) and want is not None and size != want:
                ok = False
    if not ok:
        raise ValueError(
            f"`{name}` must broadcast to the logits' shape (B, N, T, S) = "
            f"{tuple(target)}. Received: {name}.shape={tuple(x.shape)}"
        )
    for _ in range(4 - rank):
        x = x[None]
    pattern = tuple(size != 1 for size in x.shape)
    if None in x.shape:  # unknown sizes: broadcast explicitly, so the pattern holds
        sizes = (ops.shape(query)[0], target[1], ops.shape(query)[1], ops.shape(key)[1])
        x = ops.broadcast_to(x, tuple(size if full else 1 for size, full in zip(sizes, pattern)))
    return x, pattern


def _compatible(a, b):
    return a is None or b is None or a == b


def as_seed(seed):
    """A `(2,)` int32 seed for the stateless dropout inside the XLA program."""
    if seed is None:
        return _backend.get().new_seed()
    if isinstance(seed, int):
        return ops.convert_to_tensor([seed, 0], dtype="int32")
    seed = ops.convert_to_tensor(seed)
    dtype = keras.backend.standardize_dtype(seed.dtype)
    if len(seed.shape) != 1 or seed.shape[0] != 2 or "int" not in dtype:
        raise ValueError(
            f"`seed` must be an int, None, or a (2,) integer tensor. Received: seed={seed!r}"
        )
    return ops.cast(seed, "int32")
