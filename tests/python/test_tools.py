"""Tool calling over kvd's OpenAI-compatible HTTP API, with the real clients: the
openai package, langchain-openai and litellm.

tool_choice "required" and a named function are held to a grammar, so whatever
the (tiny) model samples, its calls name one of the tools and their arguments
validate against that function's parameters. With "auto" the model writes what it
likes; a model this small rarely calls, so those tests check the plumbing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from conftest import _stop_checked
from test_http import CHAT, MODEL_ID, HttpDaemon, error_of

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$", "maxLength": 24}},
    "required": ["timezone"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris today?"}]


def oai(h: HttpDaemon) -> Any:
    """The openai client, untyped here: its response types are unions of every kind of tool call
    and output item, which these tests narrow by asserting what kvd sent."""
    return h.oai


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    h = HttpDaemon(tmp_path_factory.mktemp("kvd-tools"), "--kv-memory", "64MiB", "-w", "1")
    h.d.measure_patience()
    yield h
    _stop_checked(h.d)


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and len(c.id) > 10
        assert c.function.name in names, c.function.name
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_and_named_calls_validate(api: HttpDaemon) -> None:
    # sampled at temperature 1: the grammar, not the model's skill, keeps every call valid
    for seed in range(3):
        r = oai(api).chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=1.0, seed=seed, n=4,
                                            max_tokens=200)
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls", ch.message
            assert ch.message.tool_calls is not None and len(ch.message.tool_calls) == 1
            check_calls(ch.message.tool_calls, set(SCHEMAS))
            assert ch.message.content is None
    # a named function: always that one
    for name in SCHEMAS:
        r = oai(api).chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, temperature=1.0, seed=7,
                                            tool_choice={"type": "function", "function": {"name": name}},
                                            parallel_tool_calls=False, n=3, max_tokens=200)
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls"
            check_calls(ch.message.tool_calls, {name})
    # parallel calls allowed: one or more, each valid, each with its own id
    r = oai(api).chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required",
                                        temperature=1.0, seed=3, n=4, max_tokens=400)
    for ch in r.choices:
        if ch.finish_reason == "tool_calls":
            check_calls(ch.message.tool_calls, set(SCHEMAS))
            assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)
        else:
            assert ch.finish_reason == "length"


def test_streamed_deltas_assemble_to_the_same_call(api: HttpDaemon) -> None:
    kw: Any = {"model": MODEL_ID, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 200,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = oai(api).chat.completions.create(**kw)
    want = whole.choices[0].message.tool_calls
    assert want is not None and len(want) >= 1
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    n_fragments = 0
    for chunk in oai(api).chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            assert ch.delta.content in (None, "")
            for d in ch.delta.tool_calls or []:
                if d.id is not None:        # the first delta of a call: id, type, name, no arguments yet
                    assert d.index not in calls and d.type == "function" and d.function is not None
                    assert d.function.name and d.function.arguments == ""
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.function is not None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments or ""
                    n_fragments += 1
    assert finish == "tool_calls"
    assert n_fragments > 3          # the arguments came as they were generated, not at once
    got = [calls[i] for i in sorted(calls)]
    assert [(c["name"], c["arguments"]) for c in got] == [(c.function.name, c.function.arguments) for c in want]
    check_calls(want, {"get_weather"})


def test_tool_round_trip(api: HttpDaemon) -> None:
    first = oai(api).chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    second = oai(api).chat.completions.create(model=MODEL_ID, messages=history, tools=TOOLS, tool_choice="none",
                                             temperature=0, max_tokens=40)
    ch = second.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.tool_calls is None
    assert isinstance(ch.message.content, str) and ch.message.content
    # the tool's answer is in the prompt: another answer makes another prompt, of other tokens
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > 0
    other = [*history[:2], {**history[2], "content": json.dumps({"temperature": -40, "sky": "blizzard, snow"})}]
    third = oai(api).chat.completions.create(model=MODEL_ID, messages=other, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert third.usage is not None and third.usage.prompt_tokens != second.usage.prompt_tokens
    # the calls' turn, rendered the same way, is served from the cache
    assert (third.usage.prompt_tokens_details.cached_tokens or 0) > 0
    # a tool result must answer a call made before it
    s, _, b = api.post("/v1/chat/completions", {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x",
                                                                    "content": "{}"}]})
    assert "call_x" in error_of(s, b, 400, "messages")["message"]
    s, _, b = api.post("/v1/chat/completions", {"messages": [*history[:1], {**history[1], "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]}]})
    error_of(s, b, 400, "messages")


def test_auto_leaves_content_as_content(api: HttpDaemon) -> None:
    r = oai(api).chat.completions.create(model=MODEL_ID, messages=CHAT, tools=TOOLS, tool_choice="auto",
                                        temperature=0, max_tokens=40)
    ch = r.choices[0]
    if ch.message.tool_calls is None:
        assert ch.finish_reason in ("stop", "length")
        assert isinstance(ch.message.content, str) and "<tool_call>" not in ch.message.content
    else:
        assert ch.finish_reason == "tool_calls"
        check_calls(ch.message.tool_calls, set(SCHEMAS))
    # streamed, the same content (or calls)
    text = ""
    names = []
    for chunk in oai(api).chat.completions.create(model=MODEL_ID, messages=CHAT, tools=TOOLS, temperature=0,
                                                 max_tokens=40, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            names += [d.function.name for d in c.delta.tool_calls or [] if d.function and d.function.name]
    assert text == (ch.message.content or "")
    assert names == [c.function.name for c in ch.message.tool_calls or []]
    # few turns of calls before: greedy, the model calls again on its own, and the block it
    # writes is parsed into a call (compact arguments), streamed the same
    shots: list[Any] = []
    for i, city in enumerate(("Paris", "Rome", "Berlin")):
        shots += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": f"call_{i}", "type": "function", "function": {
                          "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
                  {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"temperature": 20}'},
                  {"role": "assistant", "content": f"It is 20 degrees in {city}."}]
    shots.append({"role": "user", "content": "What is the weather in Oslo?"})
    kw: Any = {"model": MODEL_ID, "messages": shots, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    r = oai(api).chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch.message
    check_calls(ch.message.tool_calls, {"get_weather"})
    assert ch.message.tool_calls is not None
    call = ch.message.tool_calls[0]
    assert call.function.arguments == json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
    streamed: dict[int, list[str]] = {}
    finish = None
    for chunk in oai(api).chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    streamed[d.index] = [d.function.name, ""]
                else:
                    streamed[d.index][1] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [tuple(v) for v in streamed.values()] == [(c.function.name, c.function.arguments)
                                                    for c in ch.message.tool_calls]
    # "none": the model is shown no tools, and its output is all content
    r = oai(api).chat.completions.create(model=MODEL_ID, messages=CHAT, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=40)
    plain = oai(api).chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=40)
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage is not None and plain.usage is not None and r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tool_fields_refused_by_name(api: HttpDaemon) -> None:
    def bad(extra: dict[str, Any], param: str, word: str = "") -> None:
        s, _, b = api.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
        e = error_of(s, b, 400, param)
        assert word in e["message"], e

    named = {"type": "function", "function": {"name": "nope"}}
    bad({"tools": TOOLS, "tool_choice": named}, "tool_choice", "nope")
    bad({"tool_choice": "required"}, "tool_choice")
    bad({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice")
    bad({"tools": {"a": 1}}, "tools")
    bad({"tools": [{"type": "retrieval"}]}, "tools")
    bad({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "name")
    bad({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice")
    bad({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools", "examples")
    bad({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}], "tool_choice": "auto"},
        "tools", "strict")
    bad({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)]}, "tools", "64")
    bad({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")
    bad({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls")
    bad({"functions": [TOOLS[0]["function"]]}, "functions")
    bad({"function_call": "auto"}, "function_call")
    # a parameters schema outside the subset: named, where the grammar holds the calls
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "patternProperties": {"^a": {"type": "string"}}}}}]
    s, _, b = api.post("/v1/chat/completions", {"messages": ASK, "tools": odd, "tool_choice": "required"})
    assert "patternProperties" in error_of(s, b, 400)["message"]
    # strict: true is served where the grammar holds the arguments
    strict = [{"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
    s, _, b = api.post("/v1/chat/completions", {"messages": ASK, "tools": strict, "tool_choice": "required",
                                                "max_tokens": 100, "temperature": 0})
    assert s == 200 and b["choices"][0]["finish_reason"] == "tool_calls", b
    # the Responses API does not take tools yet: refused by name
    s, _, b = api.post("/v1/responses", {"input": "hi", "tools": TOOLS})
    error_of(s, b, 400, "tools")


def test_langchain_openai(api: HttpDaemon) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather in a city."""
        city: str = Field(max_length=24)
        celsius: int = Field(ge=-60, le=60)

    llm = ChatOpenAI(model=MODEL_ID, base_url=api.base + "/v1", api_key="none",  # type: ignore[arg-type,call-arg]
                     temperature=0, max_tokens=200, timeout=api.d.patience, max_retries=0)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke("The weather in Oslo, as JSON.")
        assert isinstance(out, Weather), (method, out)

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}, 21 C."

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    ask = HumanMessage("What is the weather in Rome?")
    ai = bound.invoke([ask])
    assert len(ai.tool_calls) >= 1 and ai.tool_calls[0]["name"] == "get_weather"
    call = ai.tool_calls[0]
    assert isinstance(call["args"].get("city"), str)
    result = ToolMessage(content=get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = llm.bind_tools([get_weather]).invoke([ask, ai, result])
    assert isinstance(final.content, str)


def test_litellm(api: HttpDaemon) -> None:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    r = litellm.completion(model=f"openai/{MODEL_ID}", api_base=api.base + "/v1", api_key="none", messages=ASK,
                           tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200,
                           timeout=api.d.patience)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    for c in ch.message.tool_calls:
        assert c.function.name in SCHEMAS
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])



# ---- the Responses API: tools in its flat shape, function_call items, function_call_output back ----

RESP_TOOLS: list[Any] = [{"type": "function", "name": t["function"]["name"],
                          "description": t["function"]["description"], "parameters": t["function"]["parameters"],
                          "strict": True} for t in TOOLS]


def check_items(output: Any) -> list[Any]:
    calls = [o for o in output if o.type == "function_call"]
    assert calls, output
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"
        assert c.name in SCHEMAS, c.name
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


def test_responses_tool_calls(api: HttpDaemon) -> None:
    # required, one call: held to the grammar whatever is sampled
    for seed in range(3):
        r = oai(api).responses.create(model=MODEL_ID, input=ASK[0]["content"], tools=RESP_TOOLS, tool_choice="required",
                                     parallel_tool_calls=False, temperature=1.0, max_output_tokens=200,
                                     extra_body={"seed": seed})
        assert r.status == "completed" and len(check_items(r.output)) == 1 and len(r.output) == 1
        assert r.parallel_tool_calls is False and [t.name for t in r.tools] == list(SCHEMAS)
    named = oai(api).responses.create(model=MODEL_ID, input=ASK, tools=RESP_TOOLS, temperature=1.0, extra_body={"seed": 3},
                                     tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=200)
    assert {c.name for c in check_items(named.output)} == {"get_time"}
    # streamed: the events build the same items as the whole answer (greedy)
    kw: dict[str, Any] = dict(model=MODEL_ID, input=ASK, tools=RESP_TOOLS, tool_choice="required",
                              temperature=0, max_output_tokens=200)
    whole = oai(api).responses.create(**kw)
    types: list[str] = []
    args: dict[str, str] = {}
    with oai(api).responses.stream(**kw) as s:
        for e in s:
            types.append(e.type)
            if e.type == "response.function_call_arguments.delta":
                args[e.item_id] = args.get(e.item_id, "") + e.delta
            if e.type == "response.function_call_arguments.done":
                assert args[e.item_id] == e.arguments
        streamed = s.get_final_response()
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed" and "response.function_call_arguments.done" in types
    assert [(c.name, c.arguments) for c in check_items(streamed.output)] == \
        [(c.name, c.arguments) for c in check_items(whole.output)]
    assert [args[c.id] for c in check_items(streamed.output)] == [c.arguments for c in streamed.output]


def test_responses_tool_round_trip(api: HttpDaemon) -> None:
    first = oai(api).responses.create(model=MODEL_ID, input=ASK, tools=RESP_TOOLS, tool_choice="required",
                                     parallel_tool_calls=False, temperature=0, max_output_tokens=200)
    call = check_items(first.output)[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}
    # by previous_response_id: the stored turn (with its call) before the result; its prompt hits the cache
    loose = [dict(t, strict=False) for t in RESP_TOOLS]
    second = oai(api).responses.create(model=MODEL_ID, previous_response_id=first.id, input=[result], tools=loose,
                                      temperature=0, max_output_tokens=24)
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    # by the whole conversation sent back: the same prompt, so the same greedy answer
    again = oai(api).responses.create(model=MODEL_ID, input=ASK + [o.model_dump(exclude_none=True)
                                                                   for o in first.output] + [result],
                                     tools=loose, temperature=0, max_output_tokens=24)
    assert again.output_text == second.output_text
    assert again.usage is not None and second.usage.input_tokens == again.usage.input_tokens
    # auto: the model may write text or calls; either way a well-formed answer
    auto = oai(api).responses.create(model=MODEL_ID, input=ASK, tools=loose, temperature=0, max_output_tokens=40)
    assert auto.status in ("completed", "incomplete") and auto.output
    for o in auto.output:
        assert o.type in ("message", "function_call")
    # none: no tools shown, the same answer as without them
    none = oai(api).responses.create(model=MODEL_ID, input=ASK, tools=RESP_TOOLS, tool_choice="none", temperature=0,
                                    max_output_tokens=16)
    plain = oai(api).responses.create(model=MODEL_ID, input=ASK, temperature=0, max_output_tokens=16)
    assert none.output_text == plain.output_text


def test_responses_tool_refusals(api: HttpDaemon) -> None:
    fn = RESP_TOOLS[0]
    for body, param in [({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"tools": [dict(fn, cache_control={"type": "ephemeral"})]}, "tools"),
                        ({"tools": [fn]}, "tools"),           # strict: true with auto is not held to the schema
                        ({"tools": [fn], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
                        ({"tools": [fn], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input"),
                        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
                         "input"),
                        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
                        ({"tools": [fn], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
                         "tool_choice")]:
        s, _, b = api.post("/v1/responses", {"model": MODEL_ID, "input": "x", **body})  # type: ignore[dict-item]
        error_of(s, b, 400, param)
