"""OpenAI protocol models (pydantic) for the routes vserve serves, and their mapping to SamplingParams."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vserve.core.sampling_params import SamplingParams
from vserve.core.structured_output import StructuredOutputsParams

MAX_N = 32
MAX_LOGPROBS = 20


def _check_utf8(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (a lone surrogate escape was sent)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k)
            _check_utf8(v)
    elif isinstance(value, list):
        for v in value:
            _check_utf8(v)


# Request fields other OpenAI-compatible clients send that change nothing here: accepted and ignored
# (docs/serving.md). Any other unknown field is a 400 naming it, as OpenAI answers.
IGNORED_FIELDS = frozenset({
    "store", "metadata", "service_tier", "prediction", "priority", "request_id", "guided_decoding_backend",
    "structured_outputs_backend"})


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_utf8(data)
        return data


class OpenAIRequest(OpenAIModel):
    """A request body: the allow-listed fields are dropped before validation."""

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and IGNORED_FIELDS.intersection(data):
            data = {k: v for k, v in data.items() if k not in IGNORED_FIELDS}
        return data


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs` request field (one of them)."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(OpenAIRequest):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    # vLLM's field: the request reuses cached prefix blocks only of requests sent with the same salt (per tenant)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's names before 0.12, deprecated (docs/structured.md)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The one structured output this request asks for (ValueError for several)."""
        asked = []
        if self.structured_outputs is not None:
            f = self.structured_outputs
            asked.append(StructuredOutputsParams(json=f.json_, regex=f.regex, choice=f.choice, grammar=f.grammar,
                                                 json_object=f.json_object, structural_tag=f.structural_tag,
                                                 disable_any_whitespace=f.disable_any_whitespace))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        if any(v is not None for v in guided.values()):
            asked.append(StructuredOutputsParams(**guided))
        asked += self._format_structured()
        if len(asked) > 1:
            raise ValueError("give one structured output: structured_outputs, a guided_* field, response_format "
                             "or a tool_choice that forces a call")
        return asked[0] if asked else None

    def _format_structured(self) -> list[StructuredOutputsParams]:
        return []

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is not None:
            for key in v:
                if not key.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, n: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=n or self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            truncate_max_tokens=max_tokens is None,
            structured_outputs=self.structured(),
        )


PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # 0: with echo, score the prompt only
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None
    # vLLM's field: each choice's "prompt_logprobs", {token id: {logprob, rank, decoded_token}} per prompt token
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's beam search fields: the beam width is best_of (else n); the best n sequences are returned
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCallItem(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, as servers return it (not re-sent)
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: tool calls' arguments as objects (Qwen's, Llama's, Mistral's
        templates serialize them themselves)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise ValueError(f"tool call {c.id}: arguments are not JSON") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            msg["name"] = self.name
        return msg


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)

    def conversation(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for the system role.
        return [m.for_template() for m in self.messages]

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the "
                                 f"tools ({', '.join(names)})")
        return self.tool_choice

    def _format_structured(self) -> list[StructuredOutputsParams]:
        out = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            out.append(StructuredOutputsParams(json_object=True))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            out.append(StructuredOutputsParams(json=rf.json_schema.schema_))
        choice = self.effective_tool_choice()
        if isinstance(choice, NamedToolChoice):
            fn = next(t.function for t in self.tools if t.function.name == choice.function.name)
            out.append(StructuredOutputsParams(json=fn.parameters or {"type": "object"}))
        elif choice == "required":
            out.append(StructuredOutputsParams(json=required_tools_schema(self.tools, self.parallel_tool_calls)))
        return out


def required_tools_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": the output is a JSON array of calls, each a tool's name and its parameters (as vLLM
    constrains it), so the arguments always validate against the tool's schema."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                "parameters": t.function.parameters or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: Annotated[str, Field(min_length=1)]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)).model_dump()
