"""The training app, the predictor and the inspection tools: TensorFlow programs.

They read IMDB through tensorflow-datasets and export TensorFlow SavedModels, so they run
Keras on its TensorFlow backend (the library itself runs on TensorFlow and JAX).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
if os.environ["KERAS_BACKEND"] != "tensorflow":
    raise ValueError(
        "The apps are TensorFlow programs (tensorflow-datasets, SavedModel, tf.distribute): run "
        "them with KERAS_BACKEND=tensorflow or unset. The library itself runs on JAX too. "
        f"Received: KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}"
    )
