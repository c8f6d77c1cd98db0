"""The top layer of the sentiment app: the training run (`python -m apps.train_sentiment`) in
its stages, run folders and seed sweeps. It may import every other layer; none imports it."""
