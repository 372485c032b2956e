"""The platform room: what makes a loaded model run on this machine, kept out of the model classes.

``cpu.py``: torch's thread count, kvscope's C++ CPU kernels (build and load), the CPU kernel of every
projection and of the LM head (packed oneDNN weights), the C++ elementwise-op switches, the oneDNN warm-up of
the prefill shapes. ``kernel_probe.py`` (and ``kernel_probe_cli.py``, its command line): the start-up probe of
this CPU's matmul kernels per weight format. ``format_choice.py``: ``--quantization auto``, the fastest
verified weight format by that probe. ``compact.py``: a loaded model's Linear layers converted to compact CPU
kernels (``quantize_model``), ``model_weight_bytes``. ``fused_decode.py``: ``FusedDecoder``, kvscope's
one-call C++ decode step, which EngineCore hands to the model runner. ``loader.py``: ``load_model`` (model
files → weight format → module → quantization → CPU switches), which returns a LoadReport beside the model.

Direction: the platform imports models (it acts on their modules) and weights (their formats and files);
kvscope.engine.models, .weights, .attention and .worker never import the platform (import-linter contracts in
pyproject.toml).
"""
