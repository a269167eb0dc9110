"""Training: the loop, its data, checkpoints, the streamed feed and experiment tracking."""
