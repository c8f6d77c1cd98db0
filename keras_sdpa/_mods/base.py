"""The machinery of `keras_sdpa.mods`: the `Mod` base, and how the core handles a mod.

A mod reaches the compiled program in two parts (`split`): a template, which keys the trace
(`static_key`), and the tensors of one call, which are the program's arguments; inside, `join`
puts them back together. `variables_of` finds the Keras variables the mods hold, and
`as_function` the plain function behind one. `WithTensors` is the one mod here: a user's
function with tensors of its own. The built-in mods are in `_mods/builtin.py`; users import
all of them from `keras_sdpa.mods`.
"""

import keras
from keras import ops


class Mod:
    """Base of the built-in mods: a callable with a config, and perhaps per-call tensors.

    A mod's config holds what is fixed (a window, a cap); its tensors (segment ids, per-row
    prefix lengths) are data of one call. The core passes the tensors into its compiled
    program as arguments, so a new batch of segment ids does not trace a new program. Two
    mods of one class with equal configs share a compiled program: a subclass's
    `get_config()` must hold all of its fixed state, and `_tensors()` / `_with_tensors()`
    its tensors.
    """

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def _tensors(self):
        """The per-call tensors, in a fixed order (a tuple; empty for most mods)."""
        return ()

    def _with_tensors(self, tensors):
        """A copy of this mod holding `tensors` instead of its own."""
        return self

    def _key(self):
        return (type(self), repr(sorted(self.get_config().items())), len(self._tensors()))

    def __eq__(self, other):
        return isinstance(other, Mod) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        args = ", ".join(f"{name}={value!r}" for name, value in self.get_config().items())
        return f"{type(self).__name__}({args})"


class WithTensors(Mod):
    """A score mod function with tensors of its own: `fn(score, b, h, q_idx, kv_idx, *tensors)`.

    The tensors enter the compiled program as its arguments, so their gradients leave it
    and a new value does not trace a new program. A tensor that a plain function captures
    instead is a constant to the core's hand-written gradients.
    """

    def __init__(self, fn, *tensors):
        if not callable(fn):
            raise ValueError(f"`fn` must be a callable. Received: fn={fn!r}")
        self.fn = fn
        self.tensors = tuple(tensors)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx, *self.tensors)

    def get_config(self):
        raise ValueError(
            "A `with_tensors` mod holds tensors and cannot be saved. Give the layer a mod that "
            f"owns its weights (a Keras layer, as relative_position_bias). Received: fn={self.fn!r}"
        )

    def _key(self):
        return (type(self), static_key(self.fn), len(self.tensors))

    def _tensors(self):
        return self.tensors

    def _with_tensors(self, tensors):
        return WithTensors(self.fn, *tensors)

    def __repr__(self):
        return f"WithTensors({self.fn!r}, {len(self.tensors)} tensors)"


# -------------------------------------------------------------- how the core handles mods


def variables_of(*mods):
    """The Keras variables the mods hold, once each, in a fixed order: a Keras layer's, and
    those of the mods a mod wraps (`and_masks`, `with_tensors`, the layer's positioned mods).
    A plain function's are not seen: on JAX it reads a variable's value at the first trace
    (see docs/backends.md)."""
    seen, variables = set(), []
    for variable in (v for mod in mods for v in _held(mod)):
        if id(variable) not in seen:
            seen.add(id(variable))
            variables.append(variable)
    return variables


def _held(mod):
    if isinstance(mod, keras.layers.Layer):
        return list(mod.variables)
    inner = []
    for name in ("fn", "inner_mask", "inner_score", "mask_mods"):
        value = getattr(mod, name, None) if isinstance(mod, Mod) else None
        for part in value if isinstance(value, tuple) else (value,):
            if part is not None:
                inner += _held(part)
    return inner


def as_function(mod):
    """The plain function behind a mod: a Keras layer's `call`, else the mod itself."""
    if isinstance(mod, keras.layers.Layer):
        return mod.call
    return mod


# Stands in for a tensor in a template: keeps the count, holds no data.
_SLOT = "<tensor>"


def tensors_of(mod):
    """The tensors `mod` holds, as it holds them: a template's are `_SLOT` placeholders."""
    return mod._tensors() if isinstance(mod, Mod) else ()


def split(mod):
    """`(template, tensors)`: what keys a trace, and the tensors of one call."""
    if isinstance(mod, Mod):
        tensors = mod._tensors()
        if not tensors:
            return mod, ()
        return mod._with_tensors((_SLOT,) * len(tensors)), tuple(
            ops.convert_to_tensor(t) for t in tensors
        )
    return mod, ()


def join(template, tensors):
    """The mod of one call, from `split`'s parts."""
    if isinstance(template, Mod) and tensors:
        return template._with_tensors(tuple(tensors))
    return template


def static_key(mod):
    """What keys a trace for `mod`: a built-in mod's config; anything else by its identity.

    A Keras layer's `repr` names only its class, name and built flag, so two loads of one
    `.keras` file (or two models after `clear_session()`) would share one traced template and
    read the first one's weights. Each plan holds its templates (`plan.Template`), and the
    compiled programs' caches hold their plans, so an `id` there is never reused while a
    program keyed by it lives.
    """
    if isinstance(mod, Mod):
        return mod._key()
    if mod is None:
        return None
    return (type(mod).__qualname__, "id", id(mod))
