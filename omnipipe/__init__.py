"""omnipipe: serve omni-modality models as independently scaled, streaming stages."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncOmni", "Omni", "__version__"]


def __getattr__(name: str) -> Any:
    # `from omnipipe import AsyncOmni, Omni`, loaded on first use: the operator, the router
    # and the workers never import the client or its HTTP library.
    if name in ("AsyncOmni", "Omni"):
        return getattr(importlib.import_module("omnipipe.client"), name)
    raise AttributeError(f"module 'omnipipe' has no attribute {name!r}")
