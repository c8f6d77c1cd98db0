"""The sentiment app's data, model and training (`python -m apps.train_sentiment`)."""
