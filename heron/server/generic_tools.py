"""heron's generic tool-calling format, for models whose chat template does not render tools (in the spirit of
llama.cpp's generic format; documented in docs/tool_calling.md).

The tools and the expected answer are described at the end of the system prompt, and a grammar holds the
answer to one JSON object:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}    to call tools
    {"response": "It is sunny in Paris."}                                         to answer directly

A history holding calls and their results is rewritten in the same terms, since the template knows neither:
an assistant message's ``tool_calls`` become its content (the first JSON above), and a ``tool`` message
becomes a user message ``{"tool_response": {"tool_call_id": ..., "content": ...}}``.
"""

from __future__ import annotations

import json
from typing import Any

RESPONSE_SCHEMA = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}


def generic_schema(calls: dict[str, Any], allow_response: bool) -> dict[str, Any]:
    """The answer's schema: ``{"tool_calls": calls}``, or (``allow_response``) that or ``{"response": str}``."""
    envelope = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
    return {"anyOf": [envelope, RESPONSE_SCHEMA]} if allow_response else envelope


def instructions(tools: list[dict[str, Any]], choice: str, function: str | None, parallel: bool) -> str:
    """The system-prompt text that describes ``tools`` and how to answer under ``choice``."""
    described = [{k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}
                 for t in tools]
    call = '{"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}'
    if choice == "named":
        ask = f'Call the tool "{function}": answer with one JSON object and nothing else, {call}.'
    elif choice == "required":
        ask = f"Call one or more of the tools: answer with one JSON object and nothing else, {call}."
    else:
        ask = (f"Answer with one JSON object and nothing else: {call} to call tools, or "
               '{"response": <your answer>} to answer the user directly.')
    once = "" if parallel else " Call one tool at a time."
    return (f"You can call the following tools. Each is given with a JSON schema of its arguments.\n"
            f"{json.dumps(described, ensure_ascii=False)}\n\n{ask}{once}")


def generic_messages(messages: list[dict[str, Any]], system_text: str | None) -> list[dict[str, Any]]:
    """``messages`` (as ``ChatMessage.to_dict`` gives them) in the generic format, with ``system_text`` added to
    the system prompt (a first system message is created if there is none)."""
    out = [_rewrite(m) for m in messages]
    if system_text:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system_text}" if out[0]["content"]
                      else system_text}
        else:
            out.insert(0, {"role": "system", "content": system_text})
    return out


def _rewrite(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in message["tool_calls"]]
        text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        content = f"{message['content']}\n{text}" if message["content"] else text
        return {"role": "assistant", "content": content}
    if message["role"] == "tool":
        response = {"tool_call_id": message.get("tool_call_id"), "content": message["content"]}
        if message.get("name"):
            response["name"] = message["name"]
        return {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
    return message
