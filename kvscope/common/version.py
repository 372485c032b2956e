"""The version both services report (OTel ``service.version``, the ``build_info`` metrics): one leaf,
imported by the engine and the gateway."""

from __future__ import annotations

import importlib.metadata


def kvscope_version() -> str:
    """The installed ``kvscope`` distribution's version (``0.1.0`` when running from a bare checkout)."""
    try:
        return importlib.metadata.version("kvscope")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"
