"""Weight bytes as stored on disk: safetensors headers (read directly: 8-byte little-endian length + JSON,
the format of https://github.com/huggingface/safetensors#format) and GGUF tensor tables."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvscope.plan.model_files import ModelFiles


def safetensors_summary(files: tuple[Path, ...]) -> dict[str, Any] | None:
    """{files, file_bytes, data_bytes, params_by_dtype} of safetensors files; None when there are none."""
    if not files:
        return None
    file_bytes = data_bytes = 0
    by_dtype: dict[str, int] = {}
    for path in files:
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        size = path.stat().st_size
        file_bytes += size
        data_bytes += size - 8 - header_len
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                by_dtype[tensor["dtype"]] = by_dtype.get(tensor["dtype"], 0) + count
    return {
        "files": [str(p) for p in files],
        "file_bytes": file_bytes,
        "data_bytes": data_bytes,
        "params_by_dtype": by_dtype,
    }


def on_disk(files: ModelFiles) -> dict[str, Any]:
    """What the model's weight files hold: ``safetensors`` and/or ``gguf`` summaries (None when absent)."""
    gguf = None
    if (
        files.gguf is not None
    ):  # tensor detail only when the model was read from the GGUF (parsing takes seconds)
        gguf = {"file": str(files.gguf), "file_bytes": files.gguf.stat().st_size}
        gguf |= asdict(files.gguf_weights) if files.gguf_weights is not None else {}
    return {"safetensors": safetensors_summary(files.safetensors), "gguf": gguf}
