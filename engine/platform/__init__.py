"""The platform room: what makes a loaded model run on this machine, kept out of the model classes.

``cpu.py``: torch's thread count, kvscope's C++ CPU kernels (build and load), the CPU kernel of every
projection and of the LM head (packed oneDNN weights), the C++ elementwise-op switches, the oneDNN warm-up of
the prefill shapes. ``loader.py``: ``load_model`` (model files → weight format → module → quantization → CPU
switches), which returns a LoadReport beside the model.

Direction: the platform imports models (it acts on their modules); kvscope.engine.models never imports the
platform (import-linter contract in pyproject.toml).
"""
