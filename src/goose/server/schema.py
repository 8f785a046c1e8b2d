"""Request bodies of the OpenAI-compatible endpoints (pydantic), and their mapping to engine options.

Unknown fields are refused (400), and so are known OpenAI fields that goose does not implement unless they
carry their neutral value (``n: 1``, ``presence_penalty: 0``, ``logprobs: false``, ...), so a client never
gets silently different behaviour from what it asked for. goose's own request fields:

- ``speculative``: a method name of `goose.METHODS`, or ``"off"`` (plain decoding, the method ``ar``);
  default: the server's ``--method``.
- ``sources``: stream each chunk with a ``goose`` object holding the text pieces and the draft source of
  their tokens (``spine``, ``branch`` or ``bonus``), tokens so far and forward calls (the playground uses it).
- ``top_k``: as in vLLM.
- ``cache_salt``: as in vLLM: requests share stored prompt prefixes only with requests of the same salt (and
  the same API key and ``user``; docs/serving.md, "Tenants").
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import GooseError

_STRICT = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: Union[str, list[str], None] = Field(default=None, validate_default=True)  # -> list[str]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    cache_salt: str | None = None  # the prefix-cache tenant, with the API key and `user`
    # goose extensions
    speculative: str | None = None
    sources: bool | None = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def unsupported(self) -> str | None:
        """Why this request asks for something goose does not do (None: nothing)."""
        if self.n not in (None, 1):
            return "n > 1 is not supported: send one request per completion"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return f"{name} is not supported (it changes the model's distribution; only 0 is accepted)"
        if self.logit_bias:
            return "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream: true"
        return None

    def engine_options(self) -> dict:
        """DecodeConfig sampling fields. Temperature 0 is greedy; no temperature means 1.0 (OpenAI's default)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature == 0:
            return {}
        top_k = None if self.top_k in (None, -1, 0) else self.top_k
        return {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": self.top_p,
                "seed": self.seed}

    def method(self, methods) -> str | None:
        """The engine method of `speculative` (None: the server's default)."""
        spec = self.speculative
        if spec is None:
            return None
        if spec == "off":
            return "ar"
        if spec not in methods:
            raise GooseError(f"unknown speculative method '{spec}'; choose 'off' or one of: {', '.join(methods)}")
        return spec


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> str | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs are not supported"
        return super().unsupported()

    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.logprobs:
            return "logprobs are not supported"
        if self.best_of not in (None, 1):
            return "best_of > 1 is not supported"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()

    def prompt_input(self) -> str | list[int]:
        """One text or one list of token ids (a batch of prompts is refused)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise GooseError("the prompt is empty")
        if all(isinstance(x, int) for x in p):
            return list(p)
        if len(p) != 1:
            raise GooseError("a batch of prompts is not supported: send one request per prompt")
        return p[0]

    def max_new(self) -> int | None:
        return self.max_tokens
