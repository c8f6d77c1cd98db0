"""Put `ScaledDotProductAttention` in place of the attention inside Keras and keras-hub models.

Two ways, as Transformers' `attn_implementation` offers both:

- `replace_attention(model)` swaps the attention layers of a model already built (loaded
  from a preset, or trained): each `keras.layers.MultiHeadAttention`,
  `keras.layers.GroupQueryAttention` and keras-hub `CachedMultiHeadAttention`, at any depth,
  becomes a `ScaledDotProductAttention` with the same configuration and the same weights.
- `sdpa_scope()` is a context manager under which those three classes, when constructed,
  are this layer: for code that builds models.

Subclasses of those classes that change what they compute (keras-hub's Whisper attention has
no key bias; XLNet's two-stream attention has a call of its own) and a model's own attention
classes (Gemma, Llama) are left as they are, and the report names them.
"""

import contextlib
import dataclasses
import inspect
import sys

import keras
from keras.src.ops.node import KerasHistory

from keras_sdpa.layer import ScaledDotProductAttention


def _cached_attention_class():
    """keras-hub's `CachedMultiHeadAttention`, if keras-hub is installed."""
    try:
        from keras_hub.src.layers.modeling.cached_multi_head_attention import (
            CachedMultiHeadAttention,
        )
    except ImportError:
        return None
    return CachedMultiHeadAttention


def _swappable():
    """The classes swapped: exactly these, never their subclasses."""
    classes = [keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention]
    cached = _cached_attention_class()
    return tuple(classes + ([cached] if cached is not None else []))


def _options(layer_class, args, kwargs):
    """The keyword arguments of `layer_class(*args, **kwargs)`, in this layer's names."""
    bound = inspect.signature(layer_class.__init__).bind(None, *args, **kwargs).arguments
    bound.pop("self", None)
    bound.setdefault("output_projection", True)  # Keras's layers always apply `W_O`
    bound.update(bound.pop("kwargs", {}))
    if "head_dim" in bound:  # GroupQueryAttention's names
        bound["key_dim"] = bound.pop("head_dim")
    if "num_query_heads" in bound:
        bound["num_heads"] = bound.pop("num_query_heads")
    return bound


def _config(layer):
    """`layer.get_config()` in this layer's argument names (with `W_O`, which Keras's layers
    always apply, also to one head)."""
    config = {**layer.get_config(), "output_projection": True}
    if isinstance(layer, keras.layers.GroupQueryAttention):
        config["key_dim"] = config.pop("head_dim")
        config["num_heads"] = config.pop("num_query_heads")
    return config


def _check_options(flash_attention, layer_options):
    if flash_attention not in (None, True, False):
        raise ValueError(
            f"`flash_attention` must be None, True or False. Received: "
            f"flash_attention={flash_attention!r}"
        )
    known = inspect.signature(ScaledDotProductAttention.__init__).parameters
    unknown = sorted(set(layer_options) - set(known))
    if unknown:
        raise ValueError(
            f"Unknown `ScaledDotProductAttention` arguments: {unknown}. "
            f"Received: {sorted(layer_options)}"
        )


def _overrides(flash_attention, layer_options):
    extra = dict(layer_options)
    if flash_attention is not None:
        extra["flash_attention"] = flash_attention
    return extra


@dataclasses.dataclass
class AttentionReport:
    """What `replace_attention` did.

    Attributes:
        swapped: `(path, class name)` of each layer put in this layer's place.
        left: `(path, class name, reason)` of each attention layer left as it was.
    """

    swapped: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"Swapped {len(self.swapped)} attention layer(s) for ScaledDotProductAttention"]
        lines += [f"  {path} ({name})" for path, name in self.swapped]
        if self.left:
            lines.append(f"Left {len(self.left)} as they are:")
            lines += [f"  {path} ({name}): {reason}" for path, name, reason in self.left]
        return "\n".join(lines)


def _is_attention(layer):
    return "attention" in type(layer).__name__.lower() and not isinstance(
        layer, ScaledDotProductAttention
    )


def _why_left(layer, swappable):
    """Why `layer` stays as it is, or None: a swappable layer, or no attention at all."""
    if type(layer) in swappable:
        config = layer.get_config()
        cached = type(layer) is _cached_attention_class()
        if cached and (config.get("use_gate") or config.get("sliding_window")):
            return (
                "keras-hub's cached call ignores its `use_gate` and `sliding_window`, which "
                "this layer would apply"
            )
        return None
    for base in type(layer).__mro__:  # the nearest swappable base
        if base in swappable:
            return (
                f"a subclass of {base.__name__} that changes what it builds or computes; "
                "its weights or outputs would differ"
            )
    if _is_attention(layer):
        return (
            "its own attention class, not a MultiHeadAttention, GroupQueryAttention or "
            "CachedMultiHeadAttention"
        )
    return None


def _swap(old, extra):
    """A `ScaledDotProductAttention` configured as `old`, with `old`'s weights."""
    new = ScaledDotProductAttention.from_config({**_config(old), **extra})
    new._parent_path = old._parent_path  # its variables' paths are the old ones'
    if old.built:
        new.build_from_config(old.get_build_config())
        want = [tuple(w.shape) for w in old.weights]
        got = [tuple(w.shape) for w in new.weights]
        if want != got:
            raise ValueError(
                f"Could not swap {old.name!r}: its weights {want} and the new layer's {got} "
                "differ"
            )
        new.set_weights(old.get_weights())
    return new


# Attributes that record layers for Keras's graph and TensorFlow's checkpoints; the setters
# and `_replace_in_graph` update them.
_BOOKKEEPING = frozenset(
    [
        "_nodes_by_depth", "_operations_by_depth", "_inbound_nodes", "_outbound_nodes",
        # TensorFlow's Trackable (`setattr` updates them, with the checkpoint's dependencies):
        "_self_unconditional_checkpoint_dependencies", "_self_unconditional_dependency_names",
        "_self_unconditional_deferred_dependencies", "_self_name_based_restores",
        "_self_saveable_object_factories",
    ]
)  # fmt: skip


def _replace_references(parent, old, new):
    """Points every attribute of `parent` (and list, tuple or dict inside one) that holds
    `old` at `new`, and keeps Keras's tracking (the order of `parent.weights`) and a
    functional graph's nodes in place."""
    tracker = getattr(parent, "_tracker", None)
    if tracker is not None and tracker.is_in_store("layers", old):
        tracker.replace_tracked_value("layers", old, new)
    for name, value in list(vars(parent).items()):
        if name in _BOOKKEEPING:
            continue  # TensorFlow's and Keras's own records, which their setters keep
        if value is old:
            setattr(parent, name, new)  # the TF backend's checkpoint dependency follows
        elif isinstance(value, list):  # TensorFlow's ListWrapper too
            for i, item in enumerate(list(value)):
                if item is old:
                    value[i] = new
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                if item is old:
                    value[key] = new
        elif isinstance(value, tuple) and any(item is old for item in value):
            items = [new if item is old else item for item in value]
            swapped = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
            setattr(parent, name, swapped)
    _replace_in_graph(parent, old, new)


def _replace_in_graph(parent, old, new):
    """In a functional model: the nodes that call `old` call `new`, under `new`'s keys."""
    by_depth = getattr(parent, "_nodes_by_depth", None)
    if not by_depth:
        return
    found = False
    for nodes in by_depth.values():
        for node in nodes:
            if node.operation is old:
                node.operation, found = new, True
    for operations in (getattr(parent, "_operations_by_depth", None) or {}).values():
        for i, operation in enumerate(operations):
            if operation is old:
                operations[i] = new
    if not found:
        return
    new._inbound_nodes = list(old._inbound_nodes)
    new._outbound_nodes = list(old._outbound_nodes)
    for index, node in enumerate(new._inbound_nodes):
        for position, tensor in enumerate(node.outputs):  # what the graph's config reads
            tensor._keras_history = KerasHistory(new, index, position)
    keys, prefix = parent._nodes, f"{id(old)}_ib-"
    for key in [key for key in keys if key.startswith(prefix)]:
        keys.discard(key)
        keys.add(f"{id(new)}_ib-{key[len(prefix):]}")


def _sublayers(layer):
    seen, out = set(), []
    for child in list(getattr(layer, "_layers", [])) + list(getattr(layer, "_operations", [])):
        if isinstance(child, keras.layers.Layer) and id(child) not in seen:
            seen.add(id(child))
            out.append(child)
    return out


def replace_attention(model, flash_attention=None, **layer_options):
    """Swaps a built model's attention layers for `ScaledDotProductAttention`, in place.

    Every `keras.layers.MultiHeadAttention`, `keras.layers.GroupQueryAttention` and keras-hub
    `CachedMultiHeadAttention` inside `model` (at any depth, in any sublayer's attributes,
    lists or dicts, or as a node of a functional graph) is replaced by this layer with the
    same configuration and the same weights, so the model computes what it computed before
    (to float rounding), through the XLA-compiled core. `model.weights` keeps its count, order,
    shapes and paths, and TensorFlow checkpoints follow the new layers. A `.weights.h5` file of
    the stock model loads into the swapped one where the attention is a named attribute (as in
    keras-hub's blocks); where it sits in a list, a dict or at a functional model's top level,
    the file names it by its class: load such weights before swapping. A model compiled and
    trained before the swap needs `compile` again before `fit` (its optimizer holds the old
    variables).

    Subclasses of those classes and a model's own attention classes are left as they are and
    named in the report. A model saved after the swap and loaded again is built by its own
    code: blocks that construct their attention (keras-hub's) construct Keras's again; call
    `replace_attention` after loading, or build under `sdpa_scope()`.

    Args:
        model: a Keras layer or model (built or not).
        flash_attention: `True` runs the `O(T)`-memory chunked path, `False` the dense one,
            `None` keeps each layer's own setting.
        **layer_options: other `ScaledDotProductAttention` arguments for every swapped layer
            (`implementation`, `chunk_size`, `attn_logits_soft_cap`, ...).

    Returns:
        An `AttentionReport`: what was swapped and what was left and why.

    Example:

    >>> import keras, keras_sdpa
    >>> x = keras.Input((8, 16))
    >>> y = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
    >>> model = keras.Model(x, y)
    >>> report = keras_sdpa.replace_attention(model)
    >>> len(report.swapped), report.left
    (1, [])
    """
    if type(model) in _swappable():
        raise ValueError(
            "`model` must hold the attention layers to swap, not be one: pass the model or "
            f"layer that holds it. Received: model={model.name!r} of type "
            f"{type(model).__name__}"
        )
    if not isinstance(model, keras.layers.Layer):
        raise ValueError(
            f"`model` must be a Keras layer or model. Received: model={model!r} of type "
            f"{type(model).__name__}"
        )
    _check_options(flash_attention, layer_options)
    extra = _overrides(flash_attention, layer_options)
    swappable, report, done, visited = _swappable(), AttentionReport(), {}, set()

    def visit(parent, path):
        if id(parent) in visited:
            return
        visited.add(id(parent))
        for name in ("train_function", "test_function", "predict_function", "generate_function"):
            if getattr(parent, name, None) is not None:
                setattr(parent, name, None)  # traced with the old layers
        for child in _sublayers(parent):
            where = f"{path}/{child.name}"
            why = _why_left(child, swappable)
            if type(child) in swappable and why is None:
                if id(child) not in done:
                    done[id(child)] = _swap(child, extra)
                    report.swapped.append((where, type(child).__name__))
                _replace_references(parent, child, done[id(child)])
            elif why is not None and not _sublayers_hold_attention(child, swappable):
                report.left.append((where, type(child).__name__, why))
            else:
                visit(child, where)

    visit(model, model.name)
    return report


def _sublayers_hold_attention(layer, swappable):
    """Whether `layer` is a container (a block named "...Attention...") with attention
    layers inside it, which `replace_attention` then walks into."""
    return any(
        type(child) in swappable or _sublayers_hold_attention(child, swappable)
        for child in _sublayers(layer)
    )


@contextlib.contextmanager
def sdpa_scope(flash_attention=None, **layer_options):
    """Within this scope, constructing `keras.layers.MultiHeadAttention`,
    `keras.layers.GroupQueryAttention` or keras-hub's `CachedMultiHeadAttention` makes a
    `ScaledDotProductAttention` with the same arguments (and `layer_options`).

    For code that builds models: a keras-hub backbone built inside the scope holds this layer
    in every block that constructs one of those classes by name. What counts is when the
    attention layer is constructed: keras-hub's blocks construct it in `build`, which a
    backbone runs while it is constructed, but a lone block first called after the scope gets
    Keras's layer (use `replace_attention` then). The names are restored on exit, also on an
    error. Subclasses defined before the scope (Whisper's attention) are not affected; one
    defined inside it subclasses the real class.

    Args:
        flash_attention: `True`, `False` or `None` (each layer's own), as in
            `replace_attention`.
        **layer_options: other `ScaledDotProductAttention` arguments for every such layer.

    Example:

    >>> import keras, keras_sdpa
    >>> with keras_sdpa.sdpa_scope():
    ...     layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    >>> type(layer).__name__
    'ScaledDotProductAttention'
    """
    _check_options(flash_attention, layer_options)
    extra = _overrides(flash_attention, layer_options)
    replacements = {cls: _constructor(cls, extra) for cls in _swappable()}
    try:
        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "") or ""
            if not name.startswith(("keras", "keras_hub", "tf_keras")):
                continue
            for attribute, value in list(vars(module).items()):
                if isinstance(value, type) and value in replacements and value.__module__ != name:
                    setattr(module, attribute, replacements[value])
        yield
    finally:
        # Every module, also one imported inside the scope that took a replacement by name.
        originals = {constructor: cls for cls, constructor in replacements.items()}
        for module in list(sys.modules.values()):
            for attribute, value in list(getattr(module, "__dict__", {}).items()):
                if isinstance(value, type) and value in originals:
                    setattr(module, attribute, originals[value])


def _constructor(layer_class, extra):
    """A class that, constructed with `layer_class`'s arguments, is a
    `ScaledDotProductAttention` (its instances are of exactly that class, so they
    serialize and load as it)."""

    class Constructed(ScaledDotProductAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(**{**_options(layer_class, args, kwargs), **extra})
            self.__class__ = ScaledDotProductAttention

        def __init_subclass__(cls, **kwargs):
            # A class defined inside the scope on a patched name (a module imported there)
            # subclasses the real `layer_class`, as it would outside the scope.
            super().__init_subclass__(**kwargs)
            cls.__bases__ = tuple(layer_class if base is Constructed else base
                                  for base in cls.__bases__)  # fmt: skip

    Constructed.__name__ = Constructed.__qualname__ = f"SDPA{layer_class.__name__}"
    return Constructed
