"""What `keras.ops` lacks, one small module per backend, side by side.

The attention math (`_masking.py`, `_dense.py`, `_chunked.py`, `_decode.py`) is written once,
on `keras.ops`. What `keras.ops` cannot say the same way on both backends lives here, with the
same names in `tensorflow.py` and `jax.py`, so that a reader compares them line for line (as
Keras's own `keras/src/backend/<name>/nn.py` do): the compiled entry, the custom gradient, the
half-precision product with float32 accumulation, the stateless dropout draw, the gradient of a
`score_mod`, and whether a trace runs inside a caller's compiled step.

`import keras_sdpa` never imports TensorFlow on the JAX backend: the module for the backend
Keras runs is imported on first use.
"""

import importlib

import keras

SUPPORTED = ("tensorflow", "jax")


def check():
    """The backend's name; a `ValueError` naming it and the supported ones otherwise."""
    name = keras.backend.backend()
    if name not in SUPPORTED:
        raise ValueError(
            "keras_sdpa runs on Keras's TensorFlow and JAX backends. Set KERAS_BACKEND to "
            f"'tensorflow' or 'jax' before importing keras. Received: KERAS_BACKEND={name!r}"
        )
    return name


def get():
    """The shim module of the running backend (`tensorflow.py` or `jax.py`)."""
    return importlib.import_module(f"keras_sdpa._backend.{check()}")


def do_not_convert(fn):
    """`fn` as TensorFlow's AutoGraph should leave it (it branches only on static values).

    Decided when `keras_sdpa` is imported, which works on every backend: an unsupported one
    raises at the first call instead (`check`).
    """
    if keras.backend.backend() == "tensorflow":
        return get().do_not_convert(fn)
    return fn


def compile(fn, static_argnames=()):
    """`fn` as one XLA program per static configuration, compiled by the running backend (a
    `tf.function(jit_compile=True)` or a `jax.jit`). Made when its module is imported, as
    `do_not_convert` is: on an unsupported backend `fn` is returned and raises at its first
    call (`check`)."""
    if keras.backend.backend() in SUPPORTED:
        return get().compile(fn, static_argnames=static_argnames)
    return fn
