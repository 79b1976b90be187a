"""Test settings: one thread, offline, deterministic."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tests/<area>/test_*.py import the shared tiny-model builders (tests/helpers*.py) by name
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    # The tolerance audit (tests/margins.py, `make margins`): off unless MHLA_MARGINS names a log file.
    if os.environ.get("MHLA_MARGINS"):
        from margins import Plugin

        config.pluginmanager.register(Plugin(os.environ["MHLA_MARGINS"]), "mhla-margins")
