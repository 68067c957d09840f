"""tuneyard: an HTTP service that fine-tunes language models on Ray Train + DeepSpeed."""
