"""The bottom layer of the sentiment app: the data and the classifier (its embedding, pooling
and optimizer). It imports nothing else from `apps` but `apps.cli` and `apps.files`."""
