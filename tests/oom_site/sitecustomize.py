"""A device out-of-memory error made on the CPU, for the tests of how paradit reports one: with this folder on
PYTHONPATH, every Python process of a run (the command, the forkserver, the workers forked from it) imports this at
start-up, and then each attention over exactly ``PARADIT_TEST_OOM_TOKENS`` query tokens raises the error PyTorch's
caching allocator raises, as a GPU capped below the run's need would."""

import os

if tokens := os.environ.get("PARADIT_TEST_OOM_TOKENS"):
    import torch
    import torch.nn.functional as F

    attend = F.scaled_dot_product_attention

    def attend_or_run_out(query, *args, **kwargs):
        if query.shape[-2] == int(tokens):
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.50 GiB is free."
            )
        return attend(query, *args, **kwargs)

    F.scaled_dot_product_attention = attend_or_run_out
