"""Request bodies of the OpenAI-compatible endpoints (pydantic), and their mapping to engine options.

Unknown fields are refused (400), and so are known OpenAI fields that goose does not implement unless they
carry their neutral value (``n: 1``, ``presence_penalty: 0``, ``logprobs: false``, ...), so a client never
gets silently different behaviour from what it asked for. goose's own request fields:

- ``speculative``: ``false`` or ``"off"`` (plain decoding, the method ``ar``), ``true`` (the server's
  ``--method``, also the default), or a method name among those the server offers (``--methods``; another is
  refused with 400 naming it).
- ``sources``: stream each chunk with a ``goose`` object holding the text pieces and the draft source of
  their tokens (``spine``, ``branch``, ``memory``, ``head`` or ``bonus``), tokens so far and forward calls
  (the playground uses it).
- ``top_k``: as in vLLM.
- ``cache_salt``: as in vLLM: requests share stored prompt prefixes (and the suffix memory) only with
  requests of the same salt, key scope and ``user``; a scope, not authentication (docs/serving.md,
  "Tenants").

Extension fields of vLLM's API that vLLM-compatible clients and benchmark tools send, accepted where goose
honours them exactly (docs/serving.md, "vLLM-compatible clients and dashboards"):

- ``ignore_eos: true``: the model's stop tokens do not end the request; it ends at ``max_tokens`` (or a
  stop string). Greedy output is still the plain greedy continuation, token for token.
- ``min_tokens``: 0, or (exactly honoured) with ``ignore_eos: true``, no ``stop`` strings and an explicit
  ``max_tokens`` >= ``min_tokens``, where every request generates exactly ``max_tokens`` tokens. vLLM
  honours it otherwise by masking the stop tokens' logits, which changes the greedy continuation; goose
  refuses that (400) rather than decode something else.
- Fields whose only accepted value is the one that changes nothing (`NEUTRAL`): ``min_p`` 0,
  ``repetition_penalty`` 1, ``stop_token_ids`` empty, ``skip_special_tokens`` true,
  ``spaces_between_special_tokens`` true, ``include_stop_str_in_output`` false, ``priority`` 0,
  ``use_beam_search`` false, ``truncate_prompt_tokens`` null, ``prompt_logprobs`` null, ``tools`` empty,
  ``tool_choice`` "none" / "auto" (without tools), ``response_format`` text, ``parallel_tool_calls`` any;
  chat: ``add_generation_prompt`` true, ``continue_final_message`` false, ``echo`` false,
  ``chat_template_kwargs`` empty; completions: ``add_special_tokens`` true.

Fields that vLLM's and SGLang's routers (`goose replicas`) add to every request they pass on, accepted at the
value those routers send, which changes nothing here: ``no_stop_trim`` false (stop strings are cut from the
text, as OpenAI's API does), ``return_hidden_states`` false, ``separate_reasoning`` true, ``stream_reasoning``
true and ``include_reasoning`` true (goose parses no reasoning: the text is the model's, whole).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import GooseError

_STRICT = ConfigDict(extra="forbid")

# field -> the values accepted (those that change nothing); anything else is refused with a 400 naming it
NEUTRAL: dict[str, tuple] = {
    "min_p": (0,), "repetition_penalty": (1,), "stop_token_ids": ([],), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,), "priority": (0,),
    "use_beam_search": (False,), "tools": ([],), "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "echo": (False,), "chat_template_kwargs": ({},), "add_special_tokens": (True,),
    # added by vLLM's and SGLang's routers to every request they pass on
    "no_stop_trim": (False,), "return_hidden_states": (False,), "separate_reasoning": (True,),
    "stream_reasoning": (True,), "include_reasoning": (True,),
}


def _same(value, neutral) -> bool:
    """`value` is `neutral` (numbers by value, 1 == 1.0; a bool only equals a bool)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


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
    speculative: Union[bool, str, None] = None
    sources: bool | None = False
    # vLLM extensions (see the module doc)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=None, ge=0)
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    use_beam_search: bool | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # routers' extensions (see the module doc)
    no_stop_trim: bool | None = None
    return_hidden_states: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None
    # OpenAI fields that only matter with tools or structured output
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

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
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options.continuous_usage_stats is not supported (usage comes in the last chunk)"
        for name in ("truncate_prompt_tokens", "prompt_logprobs"):
            if getattr(self, name) is not None:
                return f"{name} is not supported (only null is accepted)"
        for name, ok in NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and not any(_same(value, v) for v in ok):
                allowed = " or ".join(json.dumps(v) for v in ok)
                return f"{name} is not supported: only {allowed} (the value that changes nothing) is accepted"
        if self.min_tokens:
            if not self.ignore_eos or self.stop:
                return ("min_tokens > 0 needs ignore_eos: true and no stop strings (then every request generates "
                        "exactly max_tokens tokens); goose does not mask stop tokens, which would change the output")
            if self.max_new() is None or self.max_new() < self.min_tokens:
                return "min_tokens needs an explicit max_tokens of at least min_tokens"
        return None

    def engine_options(self) -> dict:
        """DecodeConfig sampling fields. Temperature 0 is greedy; no temperature means 1.0 (OpenAI's default)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        stops = {"eos": []} if self.ignore_eos else {}  # Engine.submit's stop token ids: none
        if temperature == 0:
            return stops
        top_k = None if self.top_k in (None, -1, 0) else self.top_k
        return {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": self.top_p,
                "seed": self.seed, **stops}

    def method(self, methods) -> str | None:
        """The engine method of `speculative` (None: the server's default)."""
        spec = self.speculative
        if spec is None or spec is True:
            return None
        if spec is False or spec == "off":
            return "ar"
        if spec not in methods:
            raise GooseError(f"unknown speculative method '{spec}'; choose 'off' or one of: {', '.join(methods)}")
        return spec


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM extensions with a neutral value only (NEUTRAL)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    echo: bool | None = None
    chat_template_kwargs: dict | None = None

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
    add_special_tokens: bool | None = None  # vLLM: true only (NEUTRAL)

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
