"""hack/'s Python scripts, imported by the tests that check them (hack/ is no package:
`make test` runs them as scripts, with hack/ on their path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HACK = Path(__file__).resolve().parents[2] / "hack"


def hack_module(name: str, file: str | None = None) -> ModuleType:
    """hack/<file or name.py> as the module `name`, registered in sys.modules (its
    dataclasses, and the hack modules that import it, look it up there)."""
    spec = importlib.util.spec_from_file_location(name, HACK / (file or f"{name}.py"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
