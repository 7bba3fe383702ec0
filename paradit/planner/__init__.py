"""The planner: which parallel plan, precision and prompt-encoder placement to run a model with on N GPUs.

``facts`` (what a model's forward does, counted on the meta device), ``profile`` (what the hardware does, as data
under ``profiles/``), ``cost`` (one step of a plan on a profile), ``plan`` (every plan ranked), ``report`` (the
ranking as text), ``tuned`` (the shipped configurations under ``paradit/configs/``), ``choose`` (what ``--gpus N``
alone runs), ``measurements`` (the measured steps that calibrate it), ``probe`` (this machine's rates). The offline
tools live in ``benchmarks/``: ``tune_configs`` writes the shipped configurations, ``validate_planner`` checks the
predictions against ``measurements.json``. Nothing here imports torch.distributed outside the probe's workers.
"""
