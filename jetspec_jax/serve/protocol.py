"""The OpenAI-compatible wire format of the server: request and response schemas, declared once, and
the OpenAI error object `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import time
import typing
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit


class OpenAIModel(BaseModel):
    # Fields OpenAI defines that this server does not act on (user, logit_bias, ...) are ignored. Types are
    # strict, as OpenAI's API has them: "5" is not an integer, true not a number, "yes" not a boolean.
    model_config = ConfigDict(extra="ignore", strict=True)


# Errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the client caused or can act on; the HTTP layer turns it into an ErrorResponse."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _model_inside(annotation) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (list[ChatMessage] -> ChatMessage), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_inside(arg)
        if found is not None:
            return found
    return None


def error_param(model: type[BaseModel], loc: tuple) -> str | None:
    """A pydantic error location as OpenAI's `param`: ('messages', 0, 'role') -> 'messages[0].role'.
    Union branch labels in the location ('list[str]') are not fields and are skipped."""
    path, current = "", model
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif current is not None and item in current.model_fields:
            path += f".{item}" if path else item
            current = _model_inside(current.model_fields[item].annotation)
    return path or None


def validation_error(model: type[BaseModel], exc: ValidationError) -> APIError:
    """One 400 for a body that fails `model`'s schema: `param` names the first bad field, the message
    every bad field (for a union, one branch's error: see `depth`)."""
    def depth(err):  # a wrong value (the branch the client meant) beats a wrong type; then deeper first
        return not err["type"].endswith(("_type", "_parsing")), len(err["loc"])

    by_field: dict = {}
    for err in exc.errors():
        field = err["loc"][0] if err["loc"] else None
        if field not in by_field or depth(err) > depth(by_field[field]):
            by_field[field] = err
    params = [error_param(model, err["loc"]) for err in by_field.values()]
    message = "; ".join(f"{p}: {e['msg']}" if p else e["msg"] for p, e in zip(params, by_field.values()))
    return invalid_request(message, param=params[0])


# Requests


def unicode_text(text: str) -> str:
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer or UTF-8 encoder takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone surrogate (\\u{ord(text[e.start]):04x} at character {e.start}), "
                         "which is not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(unicode_text)]


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]  # OpenAI's range
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, description="0 disables top-k; at most the vocabulary (Engine.check_sampling)")]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
MaxTokens = Annotated[int, Field(ge=1)]


class SamplingFields(OpenAIModel):
    """What /v1/chat/completions and /v1/completions share."""
    model: str
    max_tokens: MaxTokens | None = None
    # OpenAI's default temperature is 1; send temperature=0 for greedy (and lossless T=0) output.
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the client's token limit or None, the field that gave it)."""
        return self.max_tokens, "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingFields):
    # One prompt: text, a list holding one text, or token ids.
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo=true is not supported")
        return echo


# Responses


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk of it (OpenAI uses one object for both)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jetspec-jax"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
