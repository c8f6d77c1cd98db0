"""What a test needs to hold on whichever backend Keras runs: tensors, NumPy views and
autodiff, written once for TensorFlow and JAX.

A test file written on `keras.ops`, NumPy and these helpers runs in the TensorFlow session and
again on JAX (`tests/backends/test_jax_backend.py`). A test that checks something only
TensorFlow has (a `tf.function` signature, a SavedModel, `tf.distribute`) carries
`@pytest.mark.tensorflow_only("why")`, and the JAX run deselects it (`tests/conftest.py`).
"""

import contextlib

import keras
import numpy as np

# The test files written on keras.ops and NumPy, which hold on both backends: this package's
# (default tier), and Keras's MHA and GQA suites and the swap into keras-hub's models (GPT-2's
# greedy tokens) (large tier: on two cores the default tier cannot hold them twice).
ON_BOTH = ["tests/backends/test_on_both_backends.py", "tests/layer/test_layer_bias.py"]
KERAS_AND_SWAP = [
    "tests/layer/test_keras_suites.py",
    "tests/swap/test_swap.py",
    "tests/swap/test_swap_exact.py",
    "tests/swap/test_swap_families.py",
    "tests/swap/test_swap_adapted.py",
    "tests/swap/test_swap_kernels.py",
]
BOTH_BACKENDS = ON_BOTH + KERAS_AND_SWAP
# The library's own test files, ported to keras.ops, NumPy and `tests/on_backend.py`: their
# default cases run again on JAX in the large tier (the default tier cannot hold a second run
# of them on two cores). Their tests of what only TensorFlow has carry `tensorflow_only`.
LIBRARY = [
    "tests/core/test_ops.py",
    "tests/core/test_chunked.py",
    "tests/mods/test_mods.py",
    "tests/core/test_core_features.py",
    "tests/core/test_decode.py",
    "tests/layer/test_cache.py",
    "tests/layer/test_layer.py",
    "tests/layer/test_layer_features.py",
    "tests/core/test_precision.py",
]

BACKEND = keras.backend.backend()
if BACKEND == "jax":
    import jax


def tensor(x, dtype=None):
    """`x` as the backend's tensor, in `dtype` (`x`'s own when None)."""
    x = np.asarray(x)
    return keras.ops.convert_to_tensor(x, dtype or x.dtype.name)


def numpy(x, dtype=None):
    """A backend tensor (bfloat16 included) as a NumPy array, in `dtype` if given."""
    x = keras.ops.convert_to_numpy(keras.ops.cast(x, dtype) if dtype else x)
    return np.asarray(x)


def gradients(fn, *args, x64=False):
    """The gradient of the scalar `fn(*args)` to every arg, by the backend's autodiff, as
    NumPy arrays. With `x64`, JAX computes in float64 (`jax.enable_x64`: JAX's default is
    float32 at most); TensorFlow always keeps the args' dtypes."""
    if BACKEND == "jax":
        with jax.enable_x64(x64 or jax.config.jax_enable_x64):
            args = [jax.numpy.asarray(a) for a in args]
            return [np.asarray(g) for g in jax.grad(fn, argnums=tuple(range(len(args))))(*args)]
    import tensorflow as tf

    args = [tf.convert_to_tensor(a) for a in args]
    with tf.GradientTape() as tape:
        tape.watch(args)
        value = fn(*args)
    return [np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(value, args)]


def gradient_to_variables(fn, variables, nonzero=True):
    """The gradients of the scalar `fn()` to Keras variables, by the backend's autodiff: on
    JAX through a `keras.StatelessScope` that reads each variable as a differentiated value.

    A variable the loss never reads gets None from TensorFlow but zeros from JAX, and two
    zero gradients compare equal: with `nonzero`, every gradient but a bias's (a key bias's
    is zero by the math: it shifts a whole row of logits) must have a non-zero entry."""
    variables = list(variables)
    if BACKEND == "jax":

        def of_values(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return fn()

        grads = [np.asarray(g) for g in jax.grad(of_values)([v.value for v in variables])]
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = fn()
        grads = tape.gradient(value, [v.value for v in variables])
        grads = [None if g is None else np.asarray(tf.convert_to_tensor(g)) for g in grads]
    if nonzero:
        unreached = [
            v.path
            for v, g in zip(variables, grads)
            if v.name != "bias" and (g is None or not np.any(g))
        ]
        assert not unreached, f"no gradient reaches {unreached}"
    return grads


def gradient_to_variable(fn, variable, nonzero=True):
    """The gradient of the scalar `fn()` to one Keras variable (`gradient_to_variables`)."""
    return gradient_to_variables(fn, [variable], nonzero)[0]


def tanh(x):
    """`tanh` in `x`'s float type, for float64 references: Keras 3.15's `ops.tanh` (and its
    other trigonometric ops) give float32 for float64 on JAX."""
    if BACKEND == "jax":
        return jax.numpy.tanh(x)
    return keras.ops.tanh(x)


def optimized_hlo(compiled, *args, **kwargs):
    """The HLO text of a compiled function (`jit`'s, or the core's) for these arguments after
    XLA's optimizations: `experimental_get_compiler_ir` on TensorFlow, lower and compile on
    JAX."""
    if BACKEND == "jax":
        return compiled.lower(*args, **kwargs).compile().as_text()
    return compiled.experimental_get_compiler_ir(*args, **kwargs)(stage="optimized_hlo")


def float64_context():
    """Where float64 exists: everywhere on TensorFlow, under `jax.enable_x64` on JAX."""
    return jax.enable_x64(True) if BACKEND == "jax" else contextlib.nullcontext()


def jit(fn):
    """`fn` compiled as a user compiles it: `jax.jit`, or `tf.function(jit_compile=True)`."""
    if BACKEND == "jax":
        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=True)


def assert_gradients_match_finite_differences(loss, tensors):
    """The backend's autodiff gradient of `loss(*tensors)` (`on_backend.gradients`) against
    central differences, per argument."""
    grads = gradients(loss, *tensors)
    arrays = [np.asarray(t) for t in tensors]
    for i, grad in enumerate(grads):

        def f(x, i=i):
            args = list(arrays)
            args[i] = x
            return float(loss(*(tensor(a) for a in args)))

        np.testing.assert_allclose(grad, numeric_gradient(f, arrays[i]), atol=1e-7, rtol=1e-6)


def numeric_gradient(f, x, eps=1e-6):
    """Central differences of a scalar function of a float64 array."""
    x = np.array(x, np.float64)
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[i] = eps
        grad[i] = (f(x + step) - f(x - step)) / (2 * eps)
    return grad


def spy_on_paths(monkeypatch, argument="path"):
    """Records one static argument (default: the path) of every call into the compiled
    core, `keras_sdpa._core.program.compiled`."""
    seen = []
    from keras_sdpa._core import program

    compiled = program.compiled

    def spy(*args, **kwargs):
        seen.append(getattr(kwargs["plan"], argument))
        return compiled(*args, **kwargs)

    monkeypatch.setattr(program, "compiled", spy)
    return seen
