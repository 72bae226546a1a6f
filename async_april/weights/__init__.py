"""The weights' formats between learner and engines: buckets for a push, weight files on disk, LoRA
merges."""
