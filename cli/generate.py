"""`vserve generate`: prompts from the command line or a file; one streamed, many batched; text or JSON lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from vserve import SamplingParams, StructuredOutputsParams  # plain dataclass modules: no torch
from vserve.cli.engine_args import build_llm, engine_command
from vserve.ops.jsonl import jsonl_objects

Message = dict[str, str]
Item = str | list[Message]  # a prompt, or a conversation for --chat
console = Console(highlight=False)
_SP = SamplingParams()


def read_schema(path: Path | None) -> StructuredOutputsParams | None:
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"--json-schema {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path} must hold a JSON object (a schema)")
    return StructuredOutputsParams(json=schema)


def read_prompts(path: Path) -> list[Item]:
    """.txt: one prompt per non-empty line; .jsonl: {"prompt": str} or {"messages": [...]} per line."""
    if not path.is_file():
        raise ValueError(f"--file {str(path)!r} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".txt":
        return [line for line in lines if line.strip()]
    if path.suffix != ".jsonl":
        raise ValueError(f"--file must be a .txt or .jsonl file, got {path.name!r}")
    items: list[Item] = []
    for lineno, obj in jsonl_objects(path, lines):
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            items.append(obj["prompt"])
        elif isinstance(obj, dict) and _is_conversation(obj.get("messages")):
            items.append(obj["messages"])
        else:
            raise ValueError(f'{path}:{lineno}: expected {{"prompt": "..."}} or '
                             f'{{"messages": [{{"role": "...", "content": "..."}}, ...]}}')
    return items


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def conversation(item: Item, system: str | None) -> list[Message]:
    conv = [{"role": "user", "content": item}] if isinstance(item, str) else list(item)
    if system is not None and conv[0]["role"] != "system":
        conv.insert(0, {"role": "system", "content": system})
    return conv


def stream_one(llm, prompt: str | list[int], params: SamplingParams):
    """Drive the engine directly and print each step's new text; RequestOutput text is cumulative."""
    engine = llm.llm_engine
    rid = "cli-stream"
    engine.add_request(rid, prompt, params)
    shown, final = 0, None
    try:
        while final is None:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                text = out.outputs[0].text
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
                if out.finished:
                    final = out
    except BaseException:
        engine.abort_request(rid)
        raise
    sys.stdout.write("\n")
    return final


def print_outputs(items: list[Item], outputs: list, as_json: bool) -> None:
    for i, (item, out) in enumerate(zip(items, outputs)):
        for c in out.outputs:
            if as_json:
                typer.echo(json.dumps({"prompt": item, "text": c.text, "token_ids": c.token_ids,
                                       "finish_reason": c.finish_reason, "index": c.index}))
                continue
            if len(items) > 1 or len(out.outputs) > 1:
                shown = item if isinstance(item, str) else item[-1]["content"]
                label = f"{i}" if len(out.outputs) == 1 else f"{i}.{c.index}"
                console.rule(Text(f"[{label}] {shown}", style="dim"), align="left")
            console.print(c.text, markup=False, soft_wrap=True)


@engine_command
def generate(
    prompts: list[str] | None = typer.Argument(None, help="Prompts, one request each.", show_default=False),
    file: Path | None = typer.Option(None, "--file", "-f", help='Prompts from a file: .txt, one per non-empty '
                                     'line; .jsonl, {"prompt": ...} or {"messages": [...]} per line.'),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to each prompt."),
    system: str | None = typer.Option(None, "--system", help="System message for --chat."),
    max_tokens: int = typer.Option(_SP.max_tokens, help="Most tokens to generate per output."),
    temperature: float = typer.Option(_SP.temperature, help="0 is greedy."),
    top_p: float = typer.Option(_SP.top_p, help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(_SP.top_k, help="Sample from the k most likely tokens; 0 or -1: no limit."),
    n: int = typer.Option(_SP.n, "--n", "-n", help="Outputs per prompt."),
    stream: bool | None = typer.Option(None, "--stream/--no-stream", show_default=False,
                                       help="Print tokens as they are generated (default: on for a single prompt)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per output line: prompt, text, "
                                 "token_ids, finish_reason, index."),
    json_schema: Path | None = typer.Option(None, "--json-schema", help="A JSON schema file every output must "
                                            "follow (structured output, xgrammar)."),
    *,
    engine_args: dict[str, Any],
) -> None:
    """Generate text for prompts given as arguments or in a --file."""
    items: list[Item] = list(prompts or []) + (read_prompts(file) if file is not None else [])
    if not items:
        raise ValueError("no prompt: pass one or more PROMPT arguments or --file prompts.txt|.jsonl")
    if system is not None and not chat:
        raise ValueError("--system needs --chat")
    if not chat and any(not isinstance(it, str) for it in items):
        raise ValueError('--file has "messages" conversations; pass --chat to apply the chat template')
    single = len(items) == 1 and n == 1 and not as_json
    if stream and not single:
        raise ValueError("--stream needs exactly one prompt, --n 1 and no --json")
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                            seed=engine_args["seed"], structured_outputs=read_schema(json_schema))

    llm = build_llm(engine_args)
    if chat:
        convs = [conversation(it, system) for it in items]
        if single and stream is not False:
            stream_one(llm, llm.apply_chat_template(convs[0]), params)
            return
        outputs = llm.chat(convs, params)
    else:
        if single and stream is not False:
            stream_one(llm, items[0], params)
            return
        outputs = llm.generate(items, params)
    print_outputs(items, outputs, as_json)
