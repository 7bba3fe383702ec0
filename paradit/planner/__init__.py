"""The planner: which parallel plan, precision and prompt-encoder placement to run a model with on N GPUs.

``facts`` (what a model's forward does, counted on the meta device), ``profile`` (what the hardware does, as data
under ``profiles/``), ``cost`` (one step of a plan on a profile), ``plan`` (every plan ranked), ``report`` (the
ranking as text), ``tuned`` and ``tune`` (the shipped configurations under ``paradit/configs/``), ``choose`` (what
``--gpus N`` alone runs), ``validate`` (predictions against the measurements in ``measurements.json``), ``probe``
(this machine's rates). Nothing here imports torch.distributed outside the probe's worker processes.
"""
