"""The patch behind `sdpa_scope`: Keras's and keras-hub's names of the attention classes,
pointed at constructors that make this layer, in the threads that are inside a scope.

The names are module attributes, so the patch is process-wide: it goes in when the first
scope opens and comes out when the last one closes (a count under a lock), whatever the order
in which overlapping scopes of several threads close. What a constructor makes is decided per
context (a `contextvars.ContextVar`: each thread, and each asyncio task, has its own): code
with no scope open gets the real class, and `isinstance` against a patched name still
recognises the real class's instances. Nested scopes merge their options, the inner one's
winning, for every class alike; closing a scope takes out its own options, also when scopes
close out of order.
"""

import contextvars
import functools
import inspect
import sys
import threading

from keras_sdpa.layer import ScaledDotProductAttention

_LOCK = threading.Lock()
_OPEN = 0  # scopes open in the process
_OPTIONS = contextvars.ContextVar("keras_sdpa_scope", default=())  # innermost last
_CONSTRUCTORS = {}  # real class: its constructor, made once


def current_options():
    """The merged options of the scopes open in this context, or None outside any scope."""
    stack = _OPTIONS.get()
    if not stack:
        return None
    merged = {}
    for options in stack:
        merged.update(options)
    return merged


def enter(classes, options, bind, kernel_classes=(), swap_kernel=None):
    """Opens a scope with `options` in this context; the first scope of the process patches
    the names of `classes`, and the constructors of `kernel_classes`. `bind(layer_class,
    args, kwargs)` gives a constructor call's arguments in this layer's names, or None where
    the class's own layer is kept; `swap_kernel(layer, options)` swaps the kernel of a
    `kernel_classes` layer constructed inside a scope. Returns the scope's entry, which
    `exit` takes."""
    global _OPEN
    with _LOCK:
        for cls in classes:
            if cls not in _CONSTRUCTORS:
                _CONSTRUCTORS[cls] = _constructor(cls, bind)
        try:
            if _OPEN == 0:
                _patch({cls: _CONSTRUCTORS[cls] for cls in classes})
            # On every entry: a family imported after an outer scope opened is covered too.
            _patch_kernel_constructors(kernel_classes, swap_kernel)
        except BaseException:
            if _OPEN == 0:
                _patch(_restoring())
                _restore_kernel_constructors()
            raise
        _OPEN += 1
    entry = dict(options)
    _OPTIONS.set((*_OPTIONS.get(), entry))
    return entry


def exit(entry):
    """Closes the scope whose options are `entry` (its own, also when scopes close out of
    order); the last scope of the process restores every name, also in modules imported
    inside a scope."""
    global _OPEN
    try:
        _OPTIONS.set(tuple(other for other in _OPTIONS.get() if other is not entry))
    finally:
        with _LOCK:
            _OPEN -= 1
            if _OPEN == 0:
                _patch(_restoring())
                _restore_kernel_constructors()


_KERNEL_INITS = {}  # a kernel class: its own `__init__`, while a scope is open


def _patch_kernel_constructors(classes, swap_kernel):
    """Wraps the `__init__` of each of `classes` (a family's own attention class, which stays
    as it is): an instance of exactly that class constructed inside a scope gets
    `swap_kernel(layer, options)`. The class's other attributes, and `isinstance`, are
    untouched; `_restore_kernel_constructors` puts each `__init__` back."""
    for cls in classes:
        if cls in _KERNEL_INITS:
            continue
        # Its own `__init__`, or None where it inherits one (Whisper's): then the wrapper,
        # set on the class, is deleted again at the end.
        _KERNEL_INITS[cls] = cls.__dict__.get("__init__")
        cls.__init__ = _swapping_init(cls, cls.__init__, swap_kernel)


def _swapping_init(cls, init, swap_kernel):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        options = current_options()
        if options is not None and type(self) is cls:  # a subclass computes its own way
            swap_kernel(self, options)

    # Keras reads the constructor's arguments from its signature (`Operation.__new__`).
    __init__.__signature__ = inspect.signature(init)
    return __init__


def _restore_kernel_constructors():
    while _KERNEL_INITS:
        cls, init = _KERNEL_INITS.popitem()
        if init is None:
            del cls.__init__
        else:
            cls.__init__ = init


def _restoring():
    return {constructor: cls for cls, constructor in _CONSTRUCTORS.items()}


def _patch(replacements):
    """Points every attribute of Keras's and keras-hub's modules (every module when
    restoring) that names a class in `replacements` at its replacement; a class's own module
    keeps it."""
    restoring = any(isinstance(cls, _Constructor) for cls in replacements)
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if not restoring and not name.startswith(("keras", "keras_hub", "tf_keras")):
            continue
        for attribute, value in list(getattr(module, "__dict__", {}).items()):
            if isinstance(value, type) and value in replacements and value.__module__ != name:
                setattr(module, attribute, replacements[value])


class _Constructor(type):
    """The metaclass of a patched name: `isinstance(layer, keras.layers.MultiHeadAttention)`
    still holds for the real class's instances while a scope is open."""

    def __instancecheck__(cls, instance):
        real = cls.__dict__.get("_real_class")
        if real is not None and isinstance(instance, real):
            return True
        return super().__instancecheck__(instance)

    def __subclasscheck__(cls, subclass):
        real = cls.__dict__.get("_real_class")
        if real is not None and issubclass(subclass, real):
            return True
        return super().__subclasscheck__(subclass)


def _constructor(layer_class, bind):
    """A class that, constructed with `layer_class`'s arguments inside a scope, is a
    `ScaledDotProductAttention` standing in for it (its instances are of exactly that class,
    so they serialize and load as it); outside any scope of the calling thread, it is
    `layer_class` itself."""

    def _arguments(args, kwargs):
        if current_options() is None:
            return None
        try:
            return bind(layer_class, args, kwargs)
        except TypeError:
            return None

    class Constructed(ScaledDotProductAttention, metaclass=_Constructor):
        _real_class = layer_class

        def __new__(cls, *args, **kwargs):
            if cls is Constructed and _arguments(args, kwargs) is None:
                # A thread with no scope open, a layer the swap keeps, or arguments that
                # the class's own constructor refuses (with its own error).
                return layer_class(*args, **kwargs)
            return super().__new__(cls, *args, **kwargs)

        def __init__(self, *args, **kwargs):
            options = {**_arguments(args, kwargs), **current_options()}
            super().__init__(**options, replaces=layer_class.__name__)
            self.__class__ = ScaledDotProductAttention

        def __init_subclass__(cls, **kwargs):
            # A class defined inside the scope on a patched name (a module imported there)
            # subclasses the real `layer_class`, as it would outside the scope.
            super().__init_subclass__(**kwargs)
            cls.__bases__ = tuple(
                layer_class if base is Constructed else base for base in cls.__bases__
            )

    Constructed.__name__ = Constructed.__qualname__ = f"SDPA{layer_class.__name__}"
    return Constructed
