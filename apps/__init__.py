"""The training app, the predictor and the inspection tools: TensorFlow programs.

They read IMDB through tensorflow-datasets and export TensorFlow SavedModels, so they run
Keras on its TensorFlow backend (the library itself runs on TensorFlow and JAX).
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Keras may already run, on the backend of ~/.keras/keras.json: that one counts then.
backend = sys.modules["keras"].backend.backend() if "keras" in sys.modules else None
if os.environ["KERAS_BACKEND"] != "tensorflow" or backend not in (None, "tensorflow"):
    raise ValueError(
        "The apps are TensorFlow programs (tensorflow-datasets, SavedModel, tf.distribute): run "
        "them with KERAS_BACKEND=tensorflow or unset. The library itself runs on JAX too. "
        f"Received: KERAS_BACKEND={backend or os.environ['KERAS_BACKEND']!r}"
    )
