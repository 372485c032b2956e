"""Models on disk: registry of known models, cache layout and pull. No torch, no engine imports.

Use ``from kvscope.common.models.pull import pull`` (the function is not re-exported here so that the name
``kvscope.common.models.pull`` keeps meaning the module).
"""

from kvscope.common.models.cache import cache_root, hf_dir, model_dir
from kvscope.common.models.pull import PullError
from kvscope.common.models.registry import (
    ModelSpec,
    UnknownModelError,
    get_model_spec,
    is_registered,
    list_models,
)

__all__ = [
    "ModelSpec",
    "PullError",
    "UnknownModelError",
    "cache_root",
    "get_model_spec",
    "hf_dir",
    "is_registered",
    "list_models",
    "model_dir",
]
