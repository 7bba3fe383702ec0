import pytest
import torch

from tests.checkpoints import build_dev_checkpoint, build_klein_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def klein_checkpoint(tmp_path_factory):
    return build_klein_checkpoint(tmp_path_factory.mktemp("klein"))


@pytest.fixture(scope="session")
def dev_checkpoint(tmp_path_factory):
    return build_dev_checkpoint(tmp_path_factory.mktemp("dev"))
