"""The sentiment app's inspection: gradients, deletion tests, the viewer page."""
