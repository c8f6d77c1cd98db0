"""Put `ScaledDotProductAttention` in place of the attention inside Keras and keras-hub models.

Two ways, as Transformers' `attn_implementation` offers both:

- `replace_attention(model)` swaps the attention layers of a model already built (loaded
  from a preset, or trained): each `keras.layers.MultiHeadAttention`,
  `keras.layers.GroupQueryAttention` and keras-hub `CachedMultiHeadAttention`, at any depth,
  becomes a `ScaledDotProductAttention` with the same configuration and the same weights.
- `sdpa_scope()` is a context manager under which those three classes, when constructed,
  are this layer: for code that builds models.

A model's own attention classes (Gemma, Llama, ...) and Whisper's subclass of keras-hub's
cached attention (no key bias) keep their class, and their kernel runs on the core
(`families.py`). Subclasses that change what they compute (XLNet's two-stream attention has a
call of its own) and the classes whose kernel is not swapped are left as they are, and the
report names them.
"""

import contextlib
import dataclasses
import functools
import inspect
import json
import warnings

import keras

from keras_sdpa._core import request
from keras_sdpa._swap import families, references
from keras_sdpa._swap import scope as _scope
from keras_sdpa.layer import ScaledDotProductAttention

# The classes as Keras defines them, read before any scope patches their public names.
_KERAS_CLASSES = (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)


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
    cached = _cached_attention_class()
    return _KERAS_CLASSES + ((cached,) if cached is not None else ())


def _config(layer):
    """`layer.get_config()` in this layer's argument names (with `W_O`, which Keras's layers
    always apply, also to one head), standing in for `layer`'s class."""
    config = {**layer.get_config(), "output_projection": True}
    if isinstance(layer, _KERAS_CLASSES[1]):  # GroupQueryAttention's names
        config["key_dim"] = config.pop("head_dim")
        config["num_heads"] = config.pop("num_query_heads")
    config["replaces"] = type(layer).__name__
    return config


def _check_options(flash_attention, layer_options):
    request.check_flash_attention(flash_attention)
    known = set(inspect.signature(ScaledDotProductAttention.__init__).parameters)
    unknown = sorted(set(layer_options) - (known - {"replaces"}))
    if unknown:
        raise ValueError(
            f"Unknown `ScaledDotProductAttention` arguments: {unknown} (`replaces` is the "
            f"swap's to set). Received: {sorted(layer_options)}"
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
        swapped: `(path, class name)` of each layer put in this layer's place: every one is
            held, and called, where the old one was.
        kernels: `(path, class name)` of each layer of a family's own attention class that
            stays, with its kernel (`_compute_attention`) run on the core (`families.py`).
        left: `(path, class name, reason)` of each attention layer left as it was.
        shared: `(holder name, path)` of each layer outside `model` that held a swapped
            layer too (another model built on the same layers), and now holds the new one.
        reset: names of the models and layers around `model` (a task around a backbone)
            whose compiled functions (`predict_function`, `generate_function`, ...) were
            traced with the old layers and are traced again on their next call.
    """

    swapped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    kernels: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    left: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    shared: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    reset: list[str] = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"Swapped {len(self.swapped)} attention layer(s) for ScaledDotProductAttention"]
        lines += [f"  {path} ({name})" for path, name in self.swapped]
        if self.kernels:
            lines.append(f"Kernel swapped in {len(self.kernels)} layer(s) of their own class:")
            lines += [f"  {path} ({name})" for path, name in self.kernels]
        if self.shared:
            lines.append(f"Also swapped where {len(self.shared)} other layer(s) held them:")
            lines += [f"  {holder}: {path}" for holder, path in self.shared]
        if self.reset:
            lines.append(f"Compiled functions reset around it: {', '.join(self.reset)}")
        if self.left:
            lines.append(f"Left {len(self.left)} as they are:")
            lines += [f"  {path} ({name}): {reason}" for path, name, reason in self.left]
        return "\n".join(lines)


def _is_attention(layer):
    """An attention class of a model's own, by its name (a layer that makes attention masks,
    as XLNet's `XLNetAttentionMaskLayer`, is none)."""
    name = type(layer).__name__.lower()
    return (
        "attention" in name
        and "attentionmask" not in name
        and not isinstance(layer, ScaledDotProductAttention)
    )


def _why_kept(layer_class, config):
    """Why a layer of `layer_class` with `config` is not swapped although its class is, or
    None."""
    cached = layer_class is _cached_attention_class()
    if cached and (config.get("use_gate") or config.get("sliding_window")):
        return (
            "keras-hub's cached call ignores its `use_gate` and `sliding_window`, which "
            "this layer would apply"
        )
    return None


def _why_left(layer, swappable):
    """Why `layer` stays as it is, or None: a swappable layer or kernel, or no attention."""
    if families.family_of(layer) is not None:
        return families.why_left(layer)
    if type(layer) in swappable:
        return _why_kept(type(layer), layer.get_config())
    for base in type(layer).__mro__:  # the nearest swappable base
        if base in swappable:
            return (
                f"a subclass of {base.__name__} that changes what it builds or computes; "
                "its weights or outputs would differ"
            )
    if _is_attention(layer):
        return families.LEFT.get(type(layer).__name__) or (
            "its own attention class, not a MultiHeadAttention, GroupQueryAttention or "
            "CachedMultiHeadAttention"
        )
    return None


# Sublayers that both classes build, by their attribute names.
_PROJECTIONS = ("_query_dense", "_key_dense", "_gate_dense", "_value_dense", "_output_dense")


def _swap(old, extra):
    """A `ScaledDotProductAttention` configured as `old`, with `old`'s weights, and with the
    `trainable` of each of its sublayers and variables."""
    new = ScaledDotProductAttention.from_config({**_config(old), **extra})
    new._parent_path = old._parent_path  # its variables' paths are the old ones'
    if not old.built:
        return new
    adapted = _adapted_projections(old)
    if adapted:
        # LoRA or quantized projections hold more than a kernel and a bias (the low-rank
        # factors; the int8 kernel and its scale): the new layer takes them as they are.
        new._adopted_projections = adapted.get
        new.build_from_config(old.get_build_config())
        del new._adopted_projections
        if [id(w) for w in new.weights] != [id(w) for w in old.weights]:
            raise ValueError(
                f"Could not swap {old.name!r}: its LoRA or quantized projections "
                f"{sorted(adapted)} are not the new layer's {[w.path for w in new.weights]}"
            )
        return new
    new.build_from_config(old.get_build_config())
    want = [tuple(w.shape) for w in old.weights]
    got = [tuple(w.shape) for w in new.weights]
    if want != got:
        raise ValueError(
            f"Could not swap {old.name!r}: its weights {want} and the new layer's {got} differ"
        )
    for name in _PROJECTIONS:
        before, after = getattr(old, name, None), getattr(new, name, None)
        if before is None or after is None:
            continue
        if before.dtype_policy.name != after.dtype_policy.name:
            raise ValueError(
                f"Could not swap {old.name!r}: its {name[1:]} runs in "
                f"{before.dtype_policy.name!r}, not in the layer's {after.dtype_policy.name!r}"
            )
        after.trainable = before.trainable
    new.set_weights(old.get_weights())
    for before, after in zip(old.weights, new.weights):
        after.trainable = before.trainable
    return new


def _adapted_projections(old):
    """`{name: sublayer}` of `old`'s projections when one of them is LoRA-enabled or quantized
    (`keras.layers.EinsumDense.enable_lora`, `.quantize`), else `{}`."""
    projections = [getattr(old, name, None) for name in _PROJECTIONS]
    projections = [dense for dense in projections if dense is not None]
    if not any(
        getattr(dense, "lora_enabled", False) or getattr(dense, "quantization_mode", None)
        for dense in projections
    ):
        return {}
    return {dense.name: dense for dense in projections}


_COMPILED = ("train_function", "test_function", "predict_function", "generate_function")


def _reset_compiled(layer):
    """Drops the functions Keras and keras-hub traced with the old layers; True if any."""
    reset = False
    for name in _COMPILED:
        if getattr(layer, name, None) is not None:
            setattr(layer, name, None)
            reset = True
    return reset


def replace_attention(
    model: keras.Layer, flash_attention: bool | None = None, **layer_options
) -> "AttentionReport":
    """Swaps a built model's attention layers for `ScaledDotProductAttention`, in place.

    Every `keras.layers.MultiHeadAttention`, `keras.layers.GroupQueryAttention` and keras-hub
    `CachedMultiHeadAttention` inside `model` (at any depth, in any sublayer's attributes,
    lists, tuples or dicts at any depth, or as a node of a functional graph) is replaced by this
    layer with the same configuration, the same weights and the same `trainable` for each
    projection and variable, standing in for its class (`replaces`): it takes that class's
    call arguments and gives a fully masked query row what that class gives. The model
    computes what it computed before (to float rounding), through the XLA-compiled core.
    `model.weights` keeps its count, order, shapes and paths, and TensorFlow checkpoints
    follow the new layers. A `.weights.h5` file of the stock model loads into the swapped one
    where the attention is a named attribute (as in keras-hub's blocks); where it sits in a
    list, a dict or at a functional model's top level, the file names it by its class: load
    such weights before swapping. A model compiled and trained before the swap needs
    `compile` again before `fit` (its optimizer holds the old variables).

    A swapped layer that a layer outside `model` holds too (another model built on the same
    layers, unless `gc.freeze()` hid it from the scan) is swapped there as well. Keras's and
    keras-hub's compiled functions (`train_function`, `test_function`, `predict_function`,
    `generate_function`) of `model`, of every layer in it and of every model around it (the
    task around a backbone) are traced again on their next call; a function of your own traced
    before the swap (`tf.function`, `jax.jit`) still runs the old layers. Both are reported.

    Subclasses of those classes and a model's own attention classes are left as they are and
    named in the report. A functional graph's config records the new layers, so its `.keras`
    file loads with them. A model whose own code constructs its attention (keras-hub's
    blocks) is rebuilt by that code when it loads, with Keras's layers: its `get_config`
    then warns, and loading it inside `sdpa_scope()` (or swapping again) keeps this layer.

    Args:
        model: a Keras layer or model (built or not).
        flash_attention: `True` runs the `O(T)`-memory chunked path, `False` the dense one,
            `None` keeps each layer's own setting.
        **layer_options: other `ScaledDotProductAttention` arguments for every swapped layer
            (`implementation`, `chunk_size`, `attn_logits_soft_cap`, ...).

    Returns:
        An `AttentionReport`: what was swapped, where else, and what was left and why.

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
    swappable, report = _swappable(), AttentionReport()
    found, visited, kernels = _find(model, swappable, report)
    kernel_options = families.options(flash_attention, layer_options) if kernels else {}
    olds = {id(old): (old, path) for _, old, path in found}
    # Where else they are held (another model built on the same layers): `(holder, old,
    # path)`. Every place is checked, and every new layer made, before anything changes.
    held = references.holders([old for old, _ in olds.values()], set(visited)) if olds else []
    shared = [
        (holder, old, path)
        for holder in held
        for old, path in olds.values()
        if references.holds(holder, old)
    ]
    for parent, old, path in found + shared:
        references.check(parent, old, path)
    swapped = {}  # id(old): the new layer
    for key, (old, path) in olds.items():
        swapped[key] = _swap(old, extra)
        report.swapped.append((path, type(old).__name__))
    for parent, old, _ in found + shared:
        references.replace(parent, old, swapped[id(old)])
    for layer in kernels:
        families.swap(layer, **kernel_options)
    report.shared = [(holder.name, path) for holder, _, path in shared]
    for layer in visited.values():
        _reset_compiled(layer)  # `model` and every layer inside it
    holders = list({id(holder): holder for holder, _, _ in shared}.values())
    around = references.enclosing([model, *holders], set(visited) | {id(h) for h in holders})
    report.reset = [layer.name for layer in holders + around if _reset_compiled(layer)]
    if swapped:
        _warn_on_config(model)
    return report


def _find(model, swappable, report):
    """Walks `model`: the `(parent, layer, path)` of each layer to swap, and every layer
    walked by id. Fills `report.left`."""
    found, visited, kernels = [], {}, []

    def visit(parent, path):
        if id(parent) in visited:
            return
        visited[id(parent)] = parent
        for child in references.sublayers(parent):
            where = f"{path}/{child.name}"
            why = _why_left(child, swappable)
            if families.family_of(child) is not None and why is None:
                if not families.is_swapped(child):
                    report.kernels.append((where, type(child).__name__))
                kernels.append(child)  # swapped before: this call's options replace its own
            elif type(child) in swappable and why is None:
                found.append((parent, child, where))
            elif why is not None and not _sublayers_hold_attention(child, swappable):
                report.left.append((where, type(child).__name__, why))
            else:
                visit(child, where)

    visit(model, model.name)
    return found, visited, kernels


def _warn_on_config(model):
    """Makes `model.get_config` warn when its config does not record every layer that stands
    in for another: a model rebuilt from it (`keras.saving.load_model`, `clone_model`) would
    hold Keras's attention again."""
    standing_in = sum(
        isinstance(layer, ScaledDotProductAttention) and layer.replaces is not None
        for layer in model._flatten_layers()
    )
    try:
        config = json.dumps(keras.saving.serialize_keras_object(model), default=str)
    except Exception:  # a model Keras cannot serialize has no config to lose the swap in
        return
    if config.count('"replaces": "') >= standing_in or hasattr(model, "_sdpa_unrecorded"):
        return
    get_config = model.get_config

    @functools.wraps(get_config)
    def warning_get_config():
        warnings.warn(
            f"The config of {model.name!r} does not record the attention layers that "
            "keras_sdpa.replace_attention swapped in: a model rebuilt from it "
            "(keras.saving.load_model, keras.models.clone_model) holds Keras's attention "
            "again. Load it inside `with keras_sdpa.sdpa_scope():`, or call "
            "`keras_sdpa.replace_attention` on the loaded model.",
            stacklevel=2,
        )
        return get_config()

    object.__setattr__(model, "_sdpa_unrecorded", True)
    object.__setattr__(model, "get_config", warning_get_config)


def _sublayers_hold_attention(layer, swappable):
    """Whether `layer` is a container (a block named "...Attention...") with attention
    layers inside it, which `replace_attention` then walks into."""
    return any(
        type(child) in swappable or _sublayers_hold_attention(child, swappable)
        for child in references.sublayers(layer)
    )


def _bind(layer_class, args, kwargs):
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


@contextlib.contextmanager
def sdpa_scope(
    flash_attention: bool | None = None, **layer_options
) -> contextlib.AbstractContextManager["AttentionReport"]:
    """Within this scope, constructing `keras.layers.MultiHeadAttention`,
    `keras.layers.GroupQueryAttention` or keras-hub's `CachedMultiHeadAttention` makes a
    `ScaledDotProductAttention` standing in for it (`replaces`), with the same arguments
    (and `layer_options`).

    For code that builds models: a keras-hub backbone built inside the scope holds this layer
    in every block that constructs one of those classes by name. What counts is when the
    attention layer is constructed: keras-hub's blocks construct it in `build`, which a
    backbone runs while it is constructed, but a lone block first called after the scope gets
    Keras's layer (use `replace_attention` then). Loading a model (`keras.saving.load_model`)
    inside the scope builds it with this layer too.

    The scope belongs to the thread (and asyncio task) that opens it: another thread
    constructing those classes meanwhile gets Keras's, and `isinstance` against their names
    holds as outside it. Nested scopes merge their options, the inner one's winning. The names
    are restored when the last open scope of the process closes, also on an error. Subclasses
    defined before the scope are not affected (Whisper's attention gets its kernel swapped);
    one defined inside it subclasses the real class.
    A keras-hub `CachedMultiHeadAttention` with `use_gate` or `sliding_window` (which its
    cached call ignores) stays as it is.

    A decoder family's own attention class (Llama's, Gemma's, ...: `replace_attention`'s
    kernel swap) constructed in the scope stays that class and runs its kernel on the core,
    with `flash_attention`, `implementation` and `chunk_size` (the other `layer_options` are
    this layer's and do not reach it). Such a model saves as the stock one; loaded inside a
    scope, its kernels are swapped again.

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
    entry = _scope.enter(
        _swappable(),
        _overrides(flash_attention, layer_options),
        _scope_arguments,
        families.loaded_classes(),
        _scope_kernel,
    )
    try:
        yield
    finally:
        _scope.exit(entry)


def _scope_kernel(layer, options):
    """Swaps the kernel of a family's attention class constructed in a scope, with the
    scope's `flash_attention`, `implementation` and `chunk_size` (its other options are
    `ScaledDotProductAttention`'s, which that class does not become)."""
    why = families.why_left(layer)
    if why:
        warnings.warn(f"sdpa_scope left {layer.name!r} as it is: {why}", stacklevel=4)
        return
    options = dict(options)
    flash_attention = options.pop("flash_attention", None)
    known = {name: options[name] for name in ("implementation", "chunk_size") if name in options}
    families.swap(layer, **families.options(flash_attention, known))


def _scope_arguments(layer_class, args, kwargs):
    """This layer's arguments for `layer_class(*args, **kwargs)` in a scope, or None where
    the class's own layer is kept."""
    bound = _bind(layer_class, args, kwargs)
    return None if _why_kept(layer_class, bound) else bound
