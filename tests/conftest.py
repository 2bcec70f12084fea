import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny():
    import speculaas as sp
    return sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0)
