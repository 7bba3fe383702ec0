import os

# The CPU runs Triton kernels (FP8 attention) only in Triton's interpreter, which is chosen as the kernels are defined:
# set before anything imports them, and inherited by every worker and subprocess the tests start.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.checkpoint_cache import cached  # noqa: E402
from tests.checkpoints import build_dev_checkpoint, build_klein_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def klein_checkpoint():
    return cached(build_klein_checkpoint)


@pytest.fixture(scope="session")
def dev_checkpoint():
    return cached(build_dev_checkpoint)
