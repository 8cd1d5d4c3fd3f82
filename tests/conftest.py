from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import omnipipe

REPO = Path(__file__).resolve().parents[1]
# The venv is shared by the checkouts with the same dependency list (hack/venv.sh), and
# its editable install points at the last one `make` ran in: never test another's code.
if Path(omnipipe.__file__).resolve().parent != REPO / "omnipipe":
    raise pytest.UsageError(
        f"the venv's omnipipe is {omnipipe.__file__}, not this checkout's ({REPO}): "
        "run `make venv` here first"
    )
# The per-tier report `make test` prints, and no skips under CI (tests/tier_report.py).
pytest_plugins = ["tests.tier_report"]


def pytest_configure(config: pytest.Config) -> None:
    # Before any test reads the family registry: the tests' outside family, kept out of
    # the venv (tests/harness/plugin_path.py).
    from tests.harness.plugin_path import activate

    activate()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/unit/golden/*.yaml from the builders instead of comparing",
    )


@pytest.fixture(scope="module", autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each module leaves os.environ as it found it. A vLLM engine started in the test
    process writes its settings there (LD_PRELOAD of torch's libgomp, thread counts,
    VLLM_* variables), and every process a later module starts would inherit them: an
    `omnipipe serve` thinker started after tests/unit/test_vllm_talker.py failed vLLM's
    CPU attention check (thread_num 2 vs 1). Torn down after the module's own fixtures,
    so its engines have stopped first."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
