"""Planning a run before it starts: the GPU planner, its rollout simulator and the learner's memory plan."""
