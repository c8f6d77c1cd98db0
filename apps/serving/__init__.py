"""The sentiment app's export and serving: the SavedModel and the plain-TensorFlow
predictor, which imports neither Keras nor keras_sdpa."""
