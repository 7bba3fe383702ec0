"""The planner: which parallel plan, precision and prompt-encoder placement to run a model with on N GPUs, from the
model's counted facts, hardware profiles (data), a cost model and measured steps; the offline tools that write its
shipped configurations and check its predictions live in ``benchmarks/``."""
