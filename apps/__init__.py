"""The training app, the predictor and the inspection tools: TensorFlow programs.

They read IMDB through tensorflow-datasets and export TensorFlow SavedModels, so they run
Keras on its TensorFlow backend (the library itself runs on TensorFlow and JAX).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
