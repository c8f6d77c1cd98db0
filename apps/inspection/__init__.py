"""The sentiment app's inspection, on the classifier and serving: gradients, deletion tests, the
exported records, the viewer page and the model card."""
