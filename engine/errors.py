"""Typed engine errors. The server maps them to OpenAI error JSON at the edge (never here)."""


class InvalidParameterError(ValueError):
    """A request parameter is invalid. ``param`` names it in OpenAI style (e.g. ``"top_logprobs"``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidParameterError):
    """Prompt tokens (+ requested completion tokens) exceed the context length actually enforced."""

    def __init__(self, *, max_model_len: int, num_prompt_tokens: int, max_tokens: int | None) -> None:
        asked = num_prompt_tokens + (max_tokens or 0)
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{asked} tokens ({num_prompt_tokens} in the messages, {max_tokens or 0} in the completion). "
            "Please reduce the length of the messages or completion."
        )
        super().__init__("messages" if max_tokens is None else "max_tokens", msg)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens


class EngineDeadError(RuntimeError):
    """The engine step loop died; every in-flight request fails with this."""
