"""Engine configuration: frozen dataclasses validated on construction (raise ValueError)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.common import engine_defaults
from kvscope.engine.core.admission import AdmissionConfig

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    """Registry name (``smollm2-135m``), a HF folder (config.json + safetensors + tokenizer) or a .gguf
    file."""
    dtype: str = "float32"
    """Weights/activations dtype: float32 (CPU default, exact parity), bfloat16, float16, or auto: on CPU
    the faster of float32/bfloat16 by a start-up probe (``kvscope.engine.platform.kernel_probe``: bfloat16
    where oneDNN runs it on AMX/AVX512_BF16), bfloat16 on CUDA."""
    quantization: str = "none"
    """Linear-layer weights (vLLM's ``--quantization``): none, int8 (weight-only, per output channel), int4
    (groups of 32; a Q4_0/Q4_1 GGUF's own blocks), gguf (the GGUF's Q4 tensors as int4, the rest dense).
    CPU only; see ``kvscope.engine.platform.compact``. auto: the fastest format the model's registry entry
    lists as verified, by the start-up probe (``kvscope.engine.platform.format_choice``; with an explicit
    dtype: none). The library keeps none/float32 as defaults (exact parity); ``kvscope engine``/``serve``
    default to auto/auto."""
    cpu_kernels: str = "auto"
    """CPU kernels for compact weights: auto = kvscope's own (kernels/cpu_decode.py: block-quantized GEMVs
    and a whole decode step in one call, for AVX-512 VNNI or AVX2 CPUs), built once per machine with the
    system C++ compiler, falling back to torch's where they cannot build; torch = torch's packed kernels only
    (the eager decoder)."""
    max_model_len: int | None = None
    """Context length enforced (prompt + completion); None = the model's max_position_embeddings."""
    served_model_name: str | None = None
    """Name reported by /v1/models; None: the registry name, a .gguf file's name without .gguf, or the HF
    folder's name (``kvscope.common.models.registry.default_served_name``)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "int4", "gguf"):
            raise ValueError(
                f"quantization must be auto, none, int8, int4 or gguf, got {self.quantization!r}"
            )
        if self.cpu_kernels not in ("auto", "torch"):
            raise ValueError(f"cpu_kernels must be auto or torch, got {self.cpu_kernels!r}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"max_model_len must be at least 16, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = engine_defaults.BLOCK_SIZE
    """Tokens per KV block."""
    kv_cache_memory: int = 1 << 30
    """KV cache budget in bytes (CPU); the number of blocks is derived from it."""
    num_blocks: int | None = None
    """Override: exact number of KV blocks (tests)."""
    memory_budget: int | None = None
    """CPU: bytes for weights and KV cache together; when set, the KV cache gets ``memory_budget`` minus the
    weights bytes of the loaded format (packed, compact and dense copies, ``kvscope.engine.platform.compact.
    model_weight_bytes``) instead of ``kv_cache_memory``."""
    gpu_memory_utilization: float = engine_defaults.GPU_MEMORY_UTILIZATION
    """CUDA: fraction of device memory for weights + activations + KV cache."""
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {self.memory_budget}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = engine_defaults.MAX_NUM_SEQS
    """Most requests in one step."""
    max_num_batched_tokens: int = engine_defaults.MAX_NUM_BATCHED_TOKENS
    """Token budget of one step (prefill chunks + decodes). A larger budget makes arriving prompts wait for
    bigger steps, a smaller one runs more steps, each re-reading the weights and re-running the decodes; the
    default is the measured best for a burst of short prompts (docs/benchmarks.md "Scheduler defaults")."""
    long_prefill_token_threshold: int = 0
    """When > 0, cap one request's prefill chunk at this many tokens so decodes are not starved."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` names). ``ngram``: prompt-lookup drafts,
    proposed by matching the last ``prompt_lookup_max`` … ``prompt_lookup_min`` tokens against the prompt
    and the output so far (engine/spec_decode/ngram.py), verified by the target model in one forward pass."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    """Most draft tokens proposed per request per step (k); the step computes 1 + k query tokens for it."""
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram that may match."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram tried first."""
    adaptive: bool = True
    """Per request: pause proposing while its acceptance rate stays low (engine/spec_decode/adaptive.py)."""
    measure_batch_cost: bool = True
    """Per step: drop drafts where the measured step times say verification does not pay at this batch size
    (engine/spec_decode/adaptive.py ``StepCostModel``). Tests that count steps turn it off."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be at least 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least prompt_lookup_min "
                f"({self.prompt_lookup_min})"
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    """None: no speculative decoding (``--speculative none``, the default)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """TTFT objectives per tier (``--ttft-slo``); none (the default): every request is queued."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:N]``."""
    attention_backend: str = "auto"
    """``auto`` (Triton on CUDA, torch elsewhere), ``torch`` or ``triton``."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None = auto: one fewer than the CPUs this process may run on, at
    least 1 (``kvscope.common.engine_defaults.default_num_threads``, applied by
    ``kvscope.engine.platform.cpu.configure_threads``): an OpenMP thread per CPU gains on batched steps when
    the machine is idle but slows every step as soon as another process wants a core (docs/benchmarks.md).
    Override with ``--num-threads``."""

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
