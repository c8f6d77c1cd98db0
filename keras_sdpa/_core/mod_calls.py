"""The mods inside a path: `score_mod` and `mask_mod` called at a block's positions in the
grouped layout, the score mod bound to a call's tensors and variables, and its gradient.
"""

import copy
import warnings

import keras
from keras import ops

from keras_sdpa import _backend
from keras_sdpa._core import layout as _layout
from keras_sdpa._mods import base as mod_base


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
    return _layout.grouped(allowed, pattern, num_kv_heads, num_heads // num_kv_heads)


class ScoreMod:
    """The score_mod of one call, and how to rebuild it around new values of what it reads.

    `params` are what its gradient reaches: its float tensors (`mods.with_tensors`, a
    `mods.Mod`'s) and, on JAX, the values of the float variables it reads. On JAX
    every Keras variable a mod holds (`base.variables_of`) enters the program as an input,
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
        fn = mod_base.as_function(mod_base.join(self.template, tensors))
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


def with_mask_mod(mask, q, s, plan, mask_mod):
    """`mask` and the mask_mod's `(B|1, K|1, G|1, T, S)` mask, combined (the dense and the
    decode paths form it whole)."""
    if mask_mod is None:
        return mask
    shape = ops.shape(q)  # (B, K, G, T, H)
    mod = mod_mask(
        mask_mod,
        _layout.batch_index(shape[0]),
        plan.num_heads,
        plan.num_kv_heads,
        ops.arange(shape[3]),
        ops.arange(s),
    )
    return mod if mask is None else ops.logical_and(mask, mod)
