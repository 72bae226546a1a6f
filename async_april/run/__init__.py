"""What a run leaves and how it is watched: the run directory and its lock, checkpoints and their
pickle-free state codec, metrics (metrics.jsonl, W&B), the console, plots, secret masking, signals."""
