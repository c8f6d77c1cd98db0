"""The layer's per-backend shims: `keras_sdpa/_backend/layer_<backend>.py`, imported on first
use, so that `import keras_sdpa.layer` does not import TensorFlow on the JAX backend."""

import importlib

import keras


def get():
    """The shim module of the backend Keras runs (`layer_tensorflow` or `layer_jax`)."""
    return importlib.import_module(f"keras_sdpa._backend.layer_{keras.backend.backend()}")
