"""keras-sdpa: scaled dot-product attention for Keras 3, compiled by XLA.

It runs on the backend Keras runs (`KERAS_BACKEND`, or `~/.keras/keras.json`): TensorFlow,
where the core is a `tf.function(jit_compile=True)`, or JAX, where it is a `jax.jit`. On
another backend the layer and the core raise an error that names it.
"""

from keras_sdpa import mods, ops
from keras_sdpa.layer import ScaledDotProductAttention
from keras_sdpa.ops import BlockMask, create_block_mask, scaled_dot_product_attention
from keras_sdpa.swap import AttentionReport, replace_attention, sdpa_scope

__version__ = "0.1.0"

__all__ = [
    "AttentionReport",
    "BlockMask",
    "ScaledDotProductAttention",
    "create_block_mask",
    "mods",
    "ops",
    "replace_attention",
    "scaled_dot_product_attention",
    "sdpa_scope",
    "__version__",
]
