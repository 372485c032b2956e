"""Weight formats and model files.

``quant.py``: int4/int8 weight tensors (GGUF Q4_0/Q4_1 blocks, kvscope's pair/tile block layouts) and the
compact linear kernel that multiplies them. ``gguf.py``: the GGUF reader (its 4-bit blocks kept as they are,
or dequantized once into a Hugging Face folder). ``files.py``: model files: resolve a name or path to a folder
(pull, convert), read its ``config.json``, build the module and copy the safetensors weights in.

Direction: weights import models (``files.py`` builds a model class); kvscope.engine.models never imports
weights, and weights never import the platform (import-linter contracts in pyproject.toml).
"""
