"""Parity mode (`model.parity`): the torch engine and the learner compute each token's logprob with the
same batch-invariant kernels, so with no staleness the behaviour logprob equals the learner's bit for bit.

    kernels.py   the batch-invariant kernels (linear, RMSNorm, rotary, SiLU, attention, log-softmax)
    model.py     `install(model, dtype)`: a Hugging Face decoder's modules routed through them

What it proves and what it costs: docs/algorithms.md, "Parity mode"; the figures: docs/benchmarks.md.
"""
