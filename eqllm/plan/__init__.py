"""`eqllm plan`: a training run's step compiled for a TPU slice from a laptop."""
