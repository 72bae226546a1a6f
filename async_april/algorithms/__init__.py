"""The maths of a step as pure tensor functions: advantages, policy losses (PPO-clip, GSPO, CISPO),
importance-sampling correction, rejection, and the staleness and mismatch figures (docs/algorithms.md)."""
