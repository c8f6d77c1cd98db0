"""What the dense and the chunked paths share: the grouped layout, the masks, the logits.

Both paths work on grouped tensors. With `N` query heads and `K = N_kv` key/value
heads (`G = N // K` query heads per key head, `G = 1` without grouping):

    q  (B, K, G, T, H)     k  (B, K, S, H)     v  (B, K, S, Hv)

Query head `n` reads key head `n // G`, as in `keras.layers.GroupQueryAttention`.
Keys and values are never repeated to `N` heads: a product `q k^T` runs on
`(B, K, G * T, H)` by `(B, K, S, H)`, the `G` heads of a group being extra rows.

Masks and biases are 5-D too, `(B|1, K|1, G|1, T|1, S|1)`: a size-1 axis
broadcasts. Which axes are full is static (a `pattern` of four bools over
`(B, N, T, S)`), so both paths know it at trace time.

The logits of a row are, in this order:

    1. s = scale * q k^T + bias
    2. s = cap * tanh(s / cap)                    (the soft cap of Gemma 2)
    3. masked: boolean mask, causal, window       (a masked key gets weight 0)

The products (`q k^T`, `p v` and the gradient's) go through `matmul`: for float32 and
float64 inputs a plain product; for bfloat16 and float16 inputs it multiplies in that
precision and accumulates in float32, and everything between the products (the scale, the
bias, the cap, the masks, the softmax) stays float32.

Everything here is `keras.ops`, the same on both backends; what differs lives in
`keras_sdpa/_backend/`.
"""

import copy
import warnings

import keras
from keras import ops

from keras_sdpa import _backend, mods

# Inputs in these dtypes are multiplied in their own precision, with float32 accumulation.
HALF_DTYPES = ("bfloat16", "float16")

# Stands in for -inf on masked logits: finite, so `logits - max` never makes a NaN.
MASKED_SCORE = -3.0e38
# Added to a masked logit on the dense path: exp(logit + MASK_PENALTY - row max) is exactly 0
# for any logit a row can hold, and the sum stays finite (no -inf, so no inf - inf).
MASK_PENALTY = -1.0e30


def grouped(x, pattern, num_kv_heads, groups):
    """A `(B|1, N|1, T|1, S|1)` mask or bias as `(B|1, K|1, G|1, T|1, S|1)`.

    `pattern[1]` says whether the head axis is full (`N`) or broadcast (1).
    """
    if x is None:
        return None
    if not pattern[1]:
        return x[:, :, None]  # (B|1, 1, 1, T|1, S|1)
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], num_kv_heads, groups, shape[2], shape[3]))


def sum_over_broadcast(d_logits, pattern):
    """Sums `(B, K, G, T, S)` logit gradients over the axes a bias of `pattern` broadcasts on."""
    axes = [0] if not pattern[0] else []
    axes += [1, 2] if not pattern[1] else []
    axes += [3] if not pattern[2] else []
    axes += [4] if not pattern[3] else []
    return ops.sum(d_logits, axis=tuple(axes), keepdims=True) if axes else d_logits


def sum_to_bias(d_logits, bias_shape, pattern):
    """`d_logits` summed to the bias's own shape."""
    return ops.reshape(sum_over_broadcast(d_logits, pattern), bias_shape)


def band(queries, keys, is_causal, window):
    """The causal and window constraints, `(len(queries), len(keys))`, or None.

    Causal: key `s` is allowed for query `t` when `s <= t` (aligned at the top
    left when `T != S`, as in Keras). Window: when `|t - s| < window`, the
    symmetric band of `keras.layers.MultiHeadAttention(sliding_window=...)`;
    with causal, the causal band of Mistral.
    """
    if not is_causal and window is None:
        return None
    offset = queries[:, None] - keys[None, :]  # (Tq, Sk)
    allowed = None
    if is_causal:
        allowed = offset >= 0
    if window is not None:
        near = ops.abs(offset) < window
        allowed = near if allowed is None else ops.logical_and(allowed, near)
    return allowed


def combine(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return ops.logical_and(a, b)


def logits(raw, bias, cap):
    """Steps 1 and 2: `raw = scale * q k^T` plus the bias, then the soft cap."""
    if bias is not None:
        raw = raw + bias
    if cap is not None:
        raw = cap * _backend.get().tanh(raw / cap)  # float64 stays float64
    return raw


def cap_derivative(capped, cap):
    """d(cap * tanh(x / cap)) / dx = 1 - tanh^2, from the capped logits themselves."""
    ratio = capped / cap
    return 1.0 - ratio * ratio


def matmul(a, b, operand=None, transpose_b=False, transpose_a=False):
    """`a @ b`, or `a @ b^T` with `transpose_b`, over the leading (batch) axes.

    With `operand=None` a plain product. With `operand` bfloat16 or float16, both sides are
    rounded to it and XLA's dot returns float32 (`preferred_element_type`): the products
    take half-precision operands and accumulate in float32, as FlashAttention, cuDNN and
    torch's SDPA multiply, and an accelerator's bfloat16/float16 units do the work. The
    float32 operands of a product (the softmax weights, the output's gradient) are rounded
    to `operand` only there. (`keras.ops.matmul` has neither the transposed operands nor
    the accumulation type: `_backend` says it for each backend.)
    """
    return _backend.get().matmul(a, b, operand, transpose_a=transpose_a, transpose_b=transpose_b)


def scaled(x, scale):
    """`x * scale`, or `x` itself when `scale` is None (the scale was folded into `q`)."""
    return x if scale is None else x * scale


def to_rows(x):
    """`(B, K, G, T, D)` as `(B, K, G * T, D)`: a group's heads become rows of one product."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], shape[2] * shape[3], shape[4]))


def from_rows(x, groups):
    """`(B, K, G * T, D)` back to `(B, K, G, T, D)`."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], groups, shape[2] // groups, shape[3]))


def keys_first(x):
    """`(…, G, T, S)` as `(…, S, G, T)`: the layout of the key-side gradient products."""
    return None if x is None else ops.transpose(x, (0, 1, 4, 2, 3))


# ------------------------------------------------------------------ score_mod and mask_mod


def batch_index(batch):
    """`b`, `(B, 1, 1, 1)` int32. Made once, outside the chunked path's loops: inside an
    XLA conditional a range over a size from outside it would not be a constant."""
    return ops.reshape(ops.arange(batch, dtype="int32"), (-1, 1, 1, 1))


def mod_indices(b, num_heads, q_pos, kv_pos):
    """FlexAttention's index tensors, int32 in the `(B, N, t, s)` layout of the logits:
    `b (B, 1, 1, 1)` (from `batch_index`), `h (1, N, 1, 1)`, `q_idx (1, 1, t, 1)`,
    `kv_idx (1, 1, 1, s)`."""
    h = ops.reshape(ops.arange(num_heads, dtype="int32"), (1, -1, 1, 1))
    q = ops.reshape(ops.cast(q_pos, "int32"), (1, 1, -1, 1))
    kv = ops.reshape(ops.cast(kv_pos, "int32"), (1, 1, 1, -1))
    return b, h, q, kv


def apply_score_mod(score_mod, raw, b, num_heads, q_pos, kv_pos):
    """`score_mod` on grouped logits `(B, K, G, t, s)`, seen by the mod as `(B, N, t, s)`.

    Query head `h` is row `h // G, h % G` of the grouped layout: the reshape is free.
    """
    shape = ops.shape(raw)
    flat = ops.reshape(raw, (shape[0], num_heads, shape[3], shape[4]))  # (B, N, t, s)
    modded = score_mod(flat, *mod_indices(b, num_heads, q_pos, kv_pos))
    modded = ops.broadcast_to(ops.cast(modded, raw.dtype), ops.shape(flat))
    return ops.reshape(modded, shape)


def mod_mask(mask_mod, b, num_heads, num_kv_heads, q_pos, kv_pos):
    """`mask_mod` at the given positions, grouped: `(B|1, K|1, G|1, t|1, s|1)` booleans."""
    allowed = ops.convert_to_tensor(mask_mod(*mod_indices(b, num_heads, q_pos, kv_pos)))
    dtype = keras.backend.standardize_dtype(allowed.dtype)
    if dtype != "bool":
        raise ValueError(
            f"`mask_mod` must return booleans (True: may attend). Received: a {dtype} tensor"
        )
    while len(allowed.shape) < 4:
        allowed = allowed[None]
    if len(allowed.shape) != 4:
        raise ValueError(
            "`mask_mod` must return a tensor that broadcasts to (B, N, t, s). "
            f"Received: shape {tuple(allowed.shape)}"
        )
    pattern = (True, allowed.shape[1] != 1, True, True)
    if allowed.shape[1] is None:
        shape = ops.shape(allowed)
        allowed = ops.broadcast_to(allowed, (shape[0], num_heads, shape[2], shape[3]))
    return grouped(allowed, pattern, num_kv_heads, num_heads // num_kv_heads)


class ScoreMod:
    """The score_mod of one call, and how to rebuild it around new values of what it reads.

    `params` are what its gradient reaches: its float tensors (`mods.with_tensors`, a
    `mods.Mod`'s) and, on JAX, the values of the float variables it reads. On JAX
    every Keras variable a mod holds (`mods.variables_of`) enters the program as an input,
    `scope` pairs them with those values, and the mod reads them through a
    `keras.StatelessScope`. `fn` is None when there is no mod.
    """

    def __init__(self, template, tensors, scope=()):
        self.template, self.tensors, self.scope = template, tuple(tensors), tuple(scope)
        floats = tuple(x for x in self.tensors if _is_float(x))
        self.params = floats + tuple(value for variable, value in self.scope if _learns(variable))
        self.fn = None if template is None else self._build(self.params)

    def _build(self, params):
        params = list(params)
        tensors = [params.pop(0) if _is_float(x) else x for x in self.tensors]
        fn = mods.as_function(mods.join(self.template, tensors))
        scope = [(v, params.pop(0) if _learns(v) else value) for v, value in self.scope]
        return reading(fn, scope)

    @property
    def constants(self):
        """Its tensors that get no gradient (segment ids): the custom gradients' constants."""
        return tuple(x for x in self.tensors if not _is_float(x))

    def bound(self, params, constants):
        """The mod reading `params` and `constants` (a custom gradient's own arguments)."""
        constants = list(constants)
        new = copy.copy(self)
        new.tensors = tuple(x if _is_float(x) else constants.pop(0) for x in self.tensors)
        return new.with_params(params)

    def with_params(self, params):
        new = copy.copy(self)
        new.params, new.fn = tuple(params), self._build(params)
        return new

    def __call__(self, *args):
        return self.fn(*args)


def reading(fn, scope):
    """`fn`, reading each variable of `scope` (pairs of a variable and a value) as that value.

    On JAX a variable the mod reads from outside what it holds is a constant of the trace:
    its later values are not read and it gets no gradient. That warns, naming it."""
    if not scope and not _backend.get().captures_variable_values():
        return fn

    def call(*args):
        with _Reading(state_mapping=list(scope)):
            return fn(*args)

    return call


class _Reading(keras.StatelessScope):
    """A `keras.StatelessScope` that warns when a variable outside its mapping is read."""

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is None:  # (`reading` uses this scope on JAX only)
            warnings.warn(
                f"A score_mod or mask_mod read the variable {variable.path!r}, which it does "
                "not hold: on JAX its value is fixed when the attention is traced, later "
                "values are not read and it gets no gradient. Hold it in a Keras layer mod, "
                "or pass it with `mods.with_tensors` (see docs/backends.md).",
                stacklevel=2,
            )
        return value


def _learns(variable):
    """Every float variable: whether it is trainable is not part of what keys a trace, so a
    mod frozen at the first trace and trained later must still get its gradient."""
    return _is_float(variable)


def _is_float(x):
    return keras.backend.is_float_dtype(x.dtype)


def mod_vjp(score_mod, raw, b, num_heads, q_pos, kv_pos, d_modded, params, variables):
    """The gradient of `score_mod`'s logits, back to `raw`, its tensors and its variables.

    Taken block by block (a tape on TensorFlow, `jax.vjp` on JAX), summed densely by the
    caller: no scatter with atomics, so the gradients are the same from run to run.
    """

    def modded(raw, params):
        rebuild = params and isinstance(score_mod, ScoreMod)  # () when only d_raw is needed
        mod = score_mod.with_params(params) if rebuild else score_mod
        return apply_score_mod(mod, raw, b, num_heads, q_pos, kv_pos)

    return _backend.get().vjp(modded, raw, list(params), list(variables), d_modded)
