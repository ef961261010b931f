import os

import pytest
import torch

# Without a GPU, Triton's interpreter runs the triton algorithm's kernels on CPU tensors (it must
# be chosen before the kernels are defined, when ampdoctor.stats.full_triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_path(tmp_path):
    return tmp_path / "run.parquet"
