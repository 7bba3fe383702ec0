import pytest
import torch

from tests.checkpoint_cache import cached
from tests.checkpoints import build_dev_checkpoint, build_klein_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def klein_checkpoint():
    return cached(build_klein_checkpoint)


@pytest.fixture(scope="session")
def dev_checkpoint():
    return cached(build_dev_checkpoint)
