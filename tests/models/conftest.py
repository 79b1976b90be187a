"""Fixtures shared by the model tests."""

import pytest
from helpers_parallel import context_parallel_results


@pytest.fixture(scope="session", params=[2, 3], ids=["P2", "P3"])
def results(request, tmp_path_factory):
    """``(world size, {case: result})``: every case of context_parallel_check.py under ``torchrun`` with 2 and
    3 processes, launched once per session (test_context_parallel.py and test_family_contract.py read it)."""
    world = request.param
    return world, context_parallel_results(world, str(tmp_path_factory.mktemp(f"cp{world}")))
