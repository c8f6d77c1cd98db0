"""The layer's arguments: the constructor's checks, the inputs' shapes, and the mods' configs.

Every error names the argument and the received value, as Keras's layers do.
"""

import keras

from keras_sdpa import mods, ops
from keras_sdpa._rank_n import normalize_axes


def check(
    num_heads, key_dim, value_dim, num_key_value_heads, dropout, output_shape, attention_axes,
    sliding_window, flash_attention, implementation, chunk_size, scale, attn_logits_soft_cap,
    score_mod, mask_mod,
):  # fmt: skip
    """Checks the constructor's arguments; returns `output_shape` (None or a tuple),
    `attention_axes` (None or a tuple) and `scale` (None or a float) as the layer keeps them."""
    check_positive_int("num_heads", num_heads)
    for name, size in (
        ("key_dim", key_dim),
        ("value_dim", value_dim),
        ("num_key_value_heads", num_key_value_heads),
    ):
        if size is not None:
            check_positive_int(name, size, or_none=True)
    if num_key_value_heads is not None and num_heads % num_key_value_heads:
        raise ValueError(
            "`num_key_value_heads` must divide `num_heads`. Received: "
            f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise ValueError(f"`dropout` must be a float in [0, 1). Received: dropout={dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout}")
    output_shape = check_output_shape(output_shape)
    if isinstance(attention_axes, int):
        attention_axes = (attention_axes,)
    elif attention_axes is not None:
        if not isinstance(attention_axes, (list, tuple)) or not all(
            isinstance(axis, int) and not isinstance(axis, bool) for axis in attention_axes
        ):
            raise ValueError(
                "`attention_axes` must be None, an int, or a tuple of ints. "
                f"Received: attention_axes={attention_axes!r}"
            )
        attention_axes = tuple(attention_axes)
    ops.check_sliding_window(sliding_window)
    if flash_attention not in (None, True, False):
        raise ValueError(
            "`flash_attention` must be None, True or False. "
            f"Received: flash_attention={flash_attention!r}"
        )
    if implementation not in ("auto", "dense", "chunked"):
        raise ValueError(
            '`implementation` must be "auto", "dense" or "chunked". '
            f"Received: implementation={implementation!r}"
        )
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0
    ):
        raise ValueError(
            f"`chunk_size` must be a positive integer or None. Received: chunk_size={chunk_size!r}"
        )
    if scale is not None:
        ops._check_scale(scale)
        scale = float(scale)
    ops.check_soft_cap(attn_logits_soft_cap)
    ops._check_mod("score_mod", score_mod)
    ops._check_mod("mask_mod", mask_mod)
    mods.check_heads(score_mod, num_heads)
    return output_shape, attention_axes, scale


def check_shapes(attention_axes, query_shape, value_shape, key_shape):
    """The inputs' shapes against each other and `attention_axes`."""
    if value_shape[1:-1] != key_shape[1:-1]:
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, must be equal. "
            f"Received: value_shape={value_shape}, key_shape={key_shape}"
        )
    for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
        if len(shape) < 3:
            raise ValueError(
                f"`{name}` must have rank 3 or more, (batch, *positions, width). "
                f"Received: {name}.shape={shape}"
            )
    if len(value_shape) != len(query_shape):
        raise ValueError(
            "`query` and `value` must have the same rank. "
            f"Received: query_shape={query_shape}, value_shape={value_shape}"
        )
    axes = normalize_axes(attention_axes, len(query_shape))
    batch_axes = [a for a in range(1, len(query_shape) - 1) if a not in axes]
    for axis in [0] + batch_axes:
        if None not in (query_shape[axis], value_shape[axis]) and (
            query_shape[axis] != value_shape[axis]
            and 1 not in (query_shape[axis], value_shape[axis])
        ):
            raise ValueError(
                f"`query` and `value` must be equal along the batch axes {[0] + batch_axes} "
                f"(those outside `attention_axes`). Received: query_shape={query_shape}, "
                f"value_shape={value_shape}"
            )


def serialize_mod(name, mod):
    """A mod's config for saving: built-ins and registered functions; others are refused."""
    if mod is None:
        return None
    if not isinstance(mod, (mods.Mod, keras.layers.Layer)):
        registered = keras.saving.get_registered_name(mod)
        if keras.saving.get_registered_object(registered) is not mod:
            raise ValueError(
                f"`{name}` must be a keras_sdpa.mods built-in or a function registered with "
                "`@keras.saving.register_keras_serializable()` to be saved: a lambda or an "
                f"unregistered function cannot be rebuilt on loading. Received: {name}={mod!r}"
            )
    if isinstance(mod, mods.Mod) and mod._tensors():
        mod.get_config()  # refuses with a clear error where the mod holds data of one batch
        raise ValueError(
            f"`{name}` holds tensors of one batch and cannot be saved; build it without them "
            f"and pass them at call time. Received: {name}={mod!r}"
        )
    return keras.saving.serialize_keras_object(mod)


def check_output_shape(output_shape):
    """`output_shape` as None or a tuple of positive ints."""
    if output_shape is None:
        return None
    shape = (output_shape,) if isinstance(output_shape, int) else output_shape
    if (
        not isinstance(shape, (tuple, list))
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    ):
        raise ValueError(
            "Invalid `output_shape`: it must be a positive int or a tuple of positive ints. "
            f"Received: output_shape={output_shape!r}"
        )
    return tuple(shape)


def check_positive_int(name, value, or_none=False):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        expected = "a positive integer or None" if or_none else "a positive integer"
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected {expected}. "
            f"Received: {name}={value!r}"
        )
