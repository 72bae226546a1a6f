"""The rollout store (its state machine, its Ray actor face, what it reports) and what it holds: trajectories, the batch a step trains, staleness admission
(eta), the auto-eta tuner. Generation actors push into it; the controller leases batches out of it."""
