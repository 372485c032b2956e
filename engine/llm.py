"""Offline API: ``LLM(model).generate(prompts, SamplingParams)`` (vLLM's ``LLM``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvscope.engine.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvscope.engine.core.admission import AdmissionConfig, parse_slos
from kvscope.engine.engine_core import EngineCore
from kvscope.engine.outputs import CompletionOutput, RequestOutput
from kvscope.engine.sampling_params import SamplingParams

PromptInput = str | list[int] | dict


def build_engine_config(model: str = DEFAULT_MODEL, **kwargs) -> EngineConfig:
    """EngineConfig from flat keyword arguments (the names of ModelConfig/CacheConfig/SchedulerConfig fields
    and ``device``, ``attention_backend``, ``num_threads``; ``ttft_slo``: admission's objectives as
    engine/core/admission.py ``parse_slos`` reads them, ``ttft_slo_quantile`` its quantile). Raises
    TypeError on an unknown name, ValueError on a bad objective or quantile."""
    groups = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
    top: dict[str, object] = {}
    speculative = _speculative_config(kwargs)
    if speculative is not None:
        top["speculative"] = speculative
    ttft_slo = kwargs.pop("ttft_slo", None)
    quantile = kwargs.pop("ttft_slo_quantile", None)
    if ttft_slo:
        slos = parse_slos(ttft_slo)
        top["admission"] = AdmissionConfig(slos) if quantile is None else AdmissionConfig(slos, quantile)
    elif quantile is not None:
        AdmissionConfig(quantile=quantile)  # a bad value is an error even with admission off
    for key, value in kwargs.items():
        owner = next((cls for cls in groups if key in cls.__dataclass_fields__), None)
        if owner is not None:
            groups[owner][key] = value
        elif key in ("device", "attention_backend", "num_threads"):
            top[key] = value
        else:
            raise TypeError(f"unknown engine option {key!r}")
    return EngineConfig(
        model=ModelConfig(model=model, **groups[ModelConfig]),
        cache=CacheConfig(**groups[CacheConfig]),
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        **top,
    )


def _speculative_config(kwargs: dict) -> SpeculativeConfig | None:
    """Pop the flat speculative options (``speculative`` = none/ngram, ``num_speculative_tokens``,
    ``prompt_lookup_min``, ``prompt_lookup_max``) from ``kwargs`` (the lookup options are ignored with
    ``speculative`` none). Raises ValueError for an unknown method or an invalid option
    (SpeculativeConfig)."""
    method = kwargs.pop("speculative", None) or "none"
    names = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    options = {name: kwargs.pop(name) for name in names if kwargs.get(name) is not None}
    for name in names:
        kwargs.pop(name, None)
    if method == "none":
        return None
    return SpeculativeConfig(method=method, **options)


class LLM:
    """Generate for a list of prompts with continuous batching; returns one RequestOutput per prompt, in
    order."""

    def __init__(self, model: str = DEFAULT_MODEL, *, config: EngineConfig | None = None, **kwargs) -> None:
        self.engine = EngineCore(config or build_engine_config(model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts: a string, token ids (list[int]), ``{"prompt_token_ids": [...]}``, or a list of those.

        Raises the engine's InvalidParameterError/PromptTooLongError before any request is queued.
        """
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        requests = [
            self.engine.input_processor.process(self._tokenize(prompt), p)
            for prompt, p in zip(prompt_list, params_list, strict=True)
        ]
        ids_in_order = []
        for request in requests:
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_engine_request(request_id, request)
            ids_in_order.append(request_id)
        return self._run(ids_in_order)

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Apply the model's chat template (add_generation_prompt) to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _tokenize(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            return list(prompt["prompt_token_ids"])
        return list(prompt)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        merged: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            result = self.engine.step()
            for output in (*result.outputs, *result.failed):  # failed: finish_reason is the reason
                merge_output(merged, output)
        return [_sorted(merged[r]) for r in request_ids]


def merge_output(merged: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Accumulate a delta RequestOutput into ``merged`` (text, token ids and logprobs concatenated per
    choice)."""
    current = merged.get(delta.request_id)
    if current is None:
        current = RequestOutput(delta.request_id, delta.prompt_token_ids, [])
        merged[delta.request_id] = current
    current.finished = delta.finished
    current.num_cached_tokens = max(current.num_cached_tokens, delta.num_cached_tokens)
    if delta.prompt_logprobs is not None:
        current.prompt_logprobs = delta.prompt_logprobs
    for choice in delta.outputs:
        target = next((c for c in current.outputs if c.index == choice.index), None)
        if target is None:
            target = CompletionOutput(
                index=choice.index, logprobs=[] if choice.logprobs is not None else None
            )
            current.outputs.append(target)
        target.text += choice.text
        target.token_ids.extend(choice.token_ids)
        if choice.logprobs is not None:
            target.logprobs = (target.logprobs or []) + choice.logprobs
        target.num_output_tokens = choice.num_output_tokens
        target.num_cached_tokens = choice.num_cached_tokens
        if choice.finish_reason is not None:
            target.finish_reason, target.stop_reason, target.stats = (
                choice.finish_reason,
                choice.stop_reason,
                choice.stats,
            )


def _sorted(output: RequestOutput) -> RequestOutput:
    output.outputs.sort(key=lambda c: c.index)
    return output


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [items]
    return items
