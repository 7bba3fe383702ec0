"""The planner: which parallel plan, precision and prompt-encoder placement to run a model with on N GPUs."""
