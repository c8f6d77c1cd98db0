"""The sentiment app's serving, on the classifier: the SavedModel and its compiled classifier,
and the plain-TensorFlow predictor, which imports neither Keras nor keras_sdpa."""
