import os

# The CPU runs Triton kernels (FP8 attention) only in Triton's interpreter, which is chosen as the kernels are defined:
# set before anything imports them, and inherited by every worker and subprocess the tests start.
os.environ["TRITON_INTERPRET"] = "1"
# The two test processes, their engines' workers and their subprocesses share two cores: an OpenMP thread that waits at
# a barrier by spinning (libgomp's default) holds a core that the thread it waits for, or another process, needs, and
# a tiny model's many short parallel regions then run 10 to 20 times slower than alone. Passive waiting changes no
# result (the same threads do the same work); it is read as the OpenMP library loads, so set before torch is imported,
# and inherited by every worker and subprocess.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Three test processes share two cores with their workers and subprocesses: one thread each (a subprocess's torch
# reads this as it starts) keeps more threads than cores from contending for them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.checkpoint_cache import cached  # noqa: E402
from tests.checkpoints import build_dev_checkpoint, build_klein_checkpoint

torch.set_num_threads(1)

# The files that take longest, slowest first (seconds summed over a 3-process run on 2 cores, 780 tests).
# ``--dist loadfile`` hands each process the next file as it finishes one, in collection order (pyproject's addopts
# turn off xdist's reordering by test count, which put these few-test files last): started first, they leave the
# short files to even out the processes' ends.
SLOWEST_FILES = [
    "test_serving.py",  # 169
    "test_hardening_server.py",  # 73 (its SIGHUP test alone: 14 s quiet, 102 s beside two other processes)
    "test_ray_serving.py",  # 63 alone (a Ray instance and three replicas start once for the file)
    "test_processes.py",  # 124
    "test_device_memory.py",  # 110
    "test_parallel_engine.py",  # 91
    "test_lora.py",  # 86
    "test_editing.py",  # 80
    "test_checkpoint_options.py",  # 55
    "test_step_cache.py",  # 55
    "test_fp8_attention.py",  # 47
    "test_serving_process.py",  # 40
    "test_front_door.py",  # 38
    "test_pipefusion.py",  # 34
    "test_planner.py",  # 32
    "test_parallel_matrix.py",  # 28
    "test_cli.py",  # 27
    "test_parallel_vae.py",  # 18
    "test_adding_a_family.py",  # 17
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def klein_checkpoint():
    return cached(build_klein_checkpoint)


@pytest.fixture(scope="session")
def dev_checkpoint():
    return cached(build_dev_checkpoint)
