"""Environment settings of the model cache. The only module of ``kvscope.common.models`` that reads the
environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "KVSCOPE_CACHE"
"""Environment variable overriding the cache root."""
DEFAULT_CACHE_ROOT = Path("~/.cache/kvscope")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    cache_root: Path
    """Root of everything kvscope downloads or converts (``<root>/models/<name>/``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ModelSettings:
        """Read ``$KVSCOPE_CACHE`` (default ``~/.cache/kvscope``), ``~`` expanded, at call time."""
        env = os.environ if environ is None else environ
        raw = env.get(CACHE_ENV) or str(DEFAULT_CACHE_ROOT)
        return cls(cache_root=Path(raw).expanduser())
