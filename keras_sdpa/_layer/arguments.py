"""The layer's arguments: the constructor's checks, the call's inputs, and the config.

Every error names the argument and the received value, as Keras's layers do.
"""

import functools
import inspect
import types

import keras
import numpy as np
from keras.src.backend import AutocastScope  # no public name

from keras_sdpa import mods
from keras_sdpa._core import request
from keras_sdpa._layer.rank_n import normalize_axes
from keras_sdpa._mods import builtin

# The constructor's arguments in its order, as `get_config` records them; those that are
# objects are saved by their serializer, the activity regularizer from where the layer keeps
# it (MultiHeadAttention's place: each projection's, not the layer's own).
ARGUMENTS = (
    "num_heads",
    "key_dim",
    "value_dim",
    "dropout",
    "use_bias",
    "output_shape",
    "attention_axes",
    "sliding_window",
    "flash_attention",
    "kernel_initializer",
    "bias_initializer",
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "use_gate",
    "seed",
    "num_key_value_heads",
    "output_projection",
    "implementation",
    "chunk_size",
    "scale",
    "attn_logits_soft_cap",
    "score_mod",
    "mask_mod",
    "context_parallel",
    "replaces",
)
# The constructor's arguments that the layer passes on to the core, as it holds them.
CORE = (
    "sliding_window",
    "attn_logits_soft_cap",
    "scale",
    "implementation",
    "chunk_size",
    "score_mod",
    "mask_mod",
    "context_parallel",
    "flash_attention",
)
_SERIALIZERS = types.MappingProxyType(
    {
        "kernel_initializer": keras.initializers.serialize,
        "bias_initializer": keras.initializers.serialize,
        "kernel_regularizer": keras.regularizers.serialize,
        "bias_regularizer": keras.regularizers.serialize,
        "activity_regularizer": keras.regularizers.serialize,
        "kernel_constraint": keras.constraints.serialize,
        "bias_constraint": keras.constraints.serialize,
        "score_mod": lambda mod: serialize_mod("score_mod", mod),
        "mask_mod": lambda mod: serialize_mod("mask_mod", mod),
    }
)


def plain_numbers(init):
    """`init` with its NumPy scalars (`np.int64(2)`, `np.float32(0.1)`, `np.True_`, in lists
    and tuples too) as Python numbers: Keras's layers take sizes computed from arrays, and
    `get_config()` stays JSON."""

    def plain(value):
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, (list, tuple)):
            items = [plain(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        args = [plain(value) for value in args]
        init(self, *args, **{name: plain(value) for name, value in kwargs.items()})

    # Keras reads the constructor's arguments from its signature (`Operation.__new__`).
    wrapped.__signature__ = inspect.signature(init)
    return wrapped


def check(
    num_heads, key_dim, value_dim, num_key_value_heads, dropout, output_shape, attention_axes, core
):
    """Checks the constructor's arguments: the layer's own, then `core`, those it passes to
    the core (as a `request.Request` checks them). Returns `output_shape` and
    `attention_axes`, each None or a tuple, as the layer keeps them."""
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
    request.check_implementation(core["implementation"], layer=True)
    request.Request(**core)
    builtin.check_heads(core["score_mod"], num_heads)
    return output_shape, attention_axes


def config(layer):
    """`{argument: value}` of `layer`'s constructor arguments (`ARGUMENTS`), as saved."""
    saved = {}
    for name in ARGUMENTS:
        value = getattr(layer, "_activity_regularizer" if name == "activity_regularizer" else name)
        saved[name] = _SERIALIZERS[name](value) if name in _SERIALIZERS else value
    return saved


def from_config(config):
    """The constructor's keyword arguments from a saved `config`: the mods rebuilt."""
    config = dict(config)
    for name in ("score_mod", "mask_mod"):
        if config.get(name) is not None:
            config[name] = keras.saving.deserialize_keras_object(config[name])
    return config


def check_call_inputs(query, value, key, widths, attention_axes):
    """The call's inputs: floating, as wide as the layer was built for (`widths` of the
    query, value and key), and shaped alike (`check_shapes`)."""
    for name, tensor, width in zip(("query", "value", "key"), (query, value, key), widths):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if not keras.backend.is_float_dtype(dtype):
            raise ValueError(f"`{name}` must be a floating tensor. Received: {name}.dtype={dtype}")
        if tensor.shape[-1] is not None and tensor.shape[-1] != width:
            raise ValueError(
                f"The last axis of `{name}` must be {width}, the width "
                f"this layer was built with. Received: {name}.shape={tuple(tensor.shape)}"
            )
    check_shapes(attention_axes, tuple(query.shape), tuple(value.shape), tuple(key.shape))


def check_overridden_core(layer_class, score_mod, mask_mod, attention_bias):
    """What reaches only the layer's own `_compute_attention`, refused for a subclass
    (`layer_class`, its name) that overrides it."""
    if score_mod is not None or mask_mod is not None:
        raise ValueError(
            "`score_mod` and `mask_mod` reach only this layer's own "
            f"`_compute_attention`; {layer_class} overrides it. Received: "
            f"score_mod={score_mod!r}, mask_mod={mask_mod!r}"
        )
    if attention_bias is not None:
        raise ValueError(
            "`attention_bias` reaches only this layer's own `_compute_attention`; "
            f"{layer_class} overrides it. Received: attention_bias with shape "
            f"{tuple(attention_bias.shape)}"
        )


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


class KeptPrecision:
    """An `attention_bias` that Keras's input conversion passes unchanged."""

    def __init__(self, value):
        self.value = value


def bias_past_autocast(layer, base, args, kwargs):
    """`kwargs` with its `attention_bias` wrapped past Keras's conversion of the call's inputs.

    Keras casts every float argument to the compute dtype: under mixed precision the bias
    would round to float16 or bfloat16 (a -1e9 mask to -inf) before the core adds it to the
    float32 logits. Left as it is: a symbolic call (a functional model's, whose node keeps
    its arguments; the real values come through `__call__` again when the model runs), and a
    subclass's own `call` (one that overrides `base.call`), which receives what Keras gives it.
    """
    own_call = type(layer).call is base.call
    bias = kwargs.get("attention_bias")
    if bias is None or isinstance(bias, KeptPrecision) or not layer.autocast or not own_call:
        return kwargs
    if any(keras.backend.is_keras_tensor(x) for x in keras.tree.flatten((args, kwargs))):
        return kwargs
    return {**kwargs, "attention_bias": KeptPrecision(bias)}


def bias_value(bias):
    """The bias `bias_past_autocast` wrapped, or `bias`; a Keras variable read in its own
    dtype.

    Inside a layer's call Keras reads a float variable in the compute dtype (its autocast
    scope, the caller's too where a wrapping layer passes its own weight): read so, a float32
    bias near 3,000 rounds to bfloat16's steps of 16. Read here without the scope, it stays
    float32, and its gradient flows to the variable as through any read of it.
    """
    bias = bias.value if isinstance(bias, KeptPrecision) else bias
    if isinstance(bias, keras.Variable):
        with AutocastScope(None):  # Keras's own switch: no cast of variables inside it
            return bias.value
    return bias
