"""The official `openai` Python SDK against eddy serve on Qwen2.5-Coder models: tool calls (a full round
trip: call -> tool result -> answer, whole and streamed; TOOLS_URL, the 1.5B) and structured outputs
(`chat.completions.parse` with pydantic models, many schemas; SCHEMA_URL, the 0.5B). Assertions are made
here; the summary goes to stdout as JSON.

usage: openai_tools.py TOOLS_URL SCHEMA_URL
"""
import json
import sys
from enum import Enum
from typing import List, Literal, Optional

import openai
from pydantic import BaseModel, Field

client = openai.OpenAI(base_url=sys.argv[1], api_key="not-needed", max_retries=0, timeout=600)
model = client.models.list().data[0].id
schema_client = openai.OpenAI(base_url=sys.argv[2], api_key="not-needed", max_retries=0, timeout=600)
out = {}

tools = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time",
        "description": "Current local time of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"]}}},
]
question = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def check_call(name, arguments):
    assert name in ("get_weather", "get_time"), name
    args = json.loads(arguments)
    assert isinstance(args.get("city"), str) and args["city"], args
    if name == "get_weather":
        assert args["unit"] in ("celsius", "fahrenheit"), args
    return args


def round_trip(stream):
    """Call (forced by tool_choice=required), then the tool's result, then the answer."""
    kw = dict(model=model, messages=question, tools=tools, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=60)
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        calls = [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert all(t.type == "function" for t in c.message.tool_calls)
    else:
        calls, finish, parts = {}, None, []
        for chunk in client.chat.completions.create(stream=True, **kw):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            for t in d.tool_calls or []:
                if t.index not in calls:
                    # The first fragment of a call carries its id and name.
                    assert t.id and t.function.name, t
                    calls[t.index] = [t.id, t.function.name, ""]
                if t.function and t.function.arguments:
                    calls[t.index][2] += t.function.arguments
            if d.content:
                parts.append(d.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "tool_calls", finish
        assert not "".join(parts).strip(), parts
        calls = [tuple(calls[i]) for i in sorted(calls)]
    assert calls, "no tool call"
    ids = [c[0] for c in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids), ids
    for _, name, args in calls:
        check_call(name, args)
    history = question + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]}]
    for i, n, a in calls:
        result = {"city": json.loads(a)["city"], "temperature": 21, "sky": "sunny"} if n == "get_weather" else "14:05"
        history.append({"role": "tool", "tool_call_id": i, "content": json.dumps(result)})
    # The answer: the history with the call and its result, without tools (with the tools in the prompt,
    # as tool_choice none keeps them, this 1.5B repeats the call as text instead of answering).
    kw = dict(model=model, messages=history, temperature=0, max_tokens=40)
    if not stream:
        a = client.chat.completions.create(**kw).choices[0]
        answer, finish = a.message.content, a.finish_reason
        assert not a.message.tool_calls, a
    else:
        parts, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        answer = "".join(parts)
    assert finish in ("stop", "length"), finish
    assert "21" in answer, answer  # the tool's result reached the model through the template
    return {"calls": [[n, json.loads(a)] for _, n, a in calls], "answer": answer, "finish_reason": finish}


out["round_trip"] = round_trip(False)
out["round_trip_stream"] = round_trip(True)

# The SDK's own stream accumulation (chat.completions.stream): the arguments arrive in several fragments
# (one per generated piece) and accumulate to the arguments of the same request answered whole.
kw = dict(model=model, messages=question, tools=tools, tool_choice="required", parallel_tool_calls=False,
          temperature=0, max_tokens=60)
whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
fragments = 0
with client.chat.completions.stream(**kw) as s:
    for ev in s:
        if ev.type == "tool_calls.function.arguments.delta":
            fragments += 1
    final = s.get_final_completion()
got = final.choices[0].message.tool_calls
assert final.choices[0].finish_reason == "tool_calls", final
assert [(t.function.name, t.function.arguments) for t in got] == [(t.function.name, t.function.arguments) for t in whole], (got, whole)
assert fragments > 1, fragments
out["stream_accumulated"] = {"fragments": fragments, "name": got[0].function.name}

# A named function, one call only.
r = client.chat.completions.create(
    model=model, messages=question, tools=tools, temperature=0, max_tokens=60, parallel_tool_calls=False,
    tool_choice={"type": "function", "function": {"name": "get_time"}})
c = r.choices[0]
assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
assert c.message.tool_calls[0].function.name == "get_time", c
check_call("get_time", c.message.tool_calls[0].function.arguments)
out["named"] = c.message.tool_calls[0].function.name

# auto: the model decides (Qwen2.5-Coder writes this call as bare JSON in a code fence: read as a call).
for stream in (False, True):
    kw = dict(model=model, messages=question, tools=tools, temperature=0, max_tokens=60)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        finish = c.finish_reason
    else:
        acc, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for t in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                acc.setdefault(t.index, ["", ""])
                acc[t.index][0] += t.function.name or ""
                acc[t.index][1] += t.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        calls = [tuple(acc[i]) for i in sorted(acc)]
    assert finish == "tool_calls" and calls, (finish, calls)
    for n, a in calls:
        check_call(n, a)
    out["auto_stream" if stream else "auto"] = calls[0][0]


# Structured outputs: pydantic models (the SDK sends strict json_schema and validates the reply).
class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


Short = Field(max_length=24)


class Point(BaseModel):
    x: int
    y: int


class Person(BaseModel):
    name: str = Short
    age: int


class Address(BaseModel):
    street: str = Short
    city: str = Short


class PersonWithAddress(BaseModel):
    name: str = Short
    address: Address


class Tags(BaseModel):
    tags: List[str] = Field(max_length=4)


class Shape(BaseModel):
    kind: Literal["circle", "square", "triangle"]
    size: float = Field(ge=0, le=100)


class Paint(BaseModel):
    color: Color
    glossy: bool


class MaybeEmail(BaseModel):
    name: str = Short
    email: Optional[str] = Field(max_length=40)


class Polygon(BaseModel):
    points: List[Point] = Field(max_length=4)


class Book(BaseModel):
    title: str = Short
    year: int
    authors: List[str] = Field(max_length=3)


class Library(BaseModel):
    books: List[Book] = Field(max_length=2)


class Step(BaseModel):
    explanation: str = Field(max_length=60)
    output: str = Short


class MathAnswer(BaseModel):
    steps: List[Step] = Field(max_length=3)
    final_answer: int


class Flag(BaseModel):
    enabled: bool


class Scores(BaseModel):
    scores: List[int] = Field(max_length=5)


class Event(BaseModel):
    title: str = Short
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    attendees: List[Person] = Field(max_length=2)


class Rgb(BaseModel):
    r: int
    g: int
    b: int


class Theme(BaseModel):
    name: str = Short
    primary: Rgb
    secondary: Optional[Rgb]


class Ingredient(BaseModel):
    item: str = Short
    grams: int


class Recipe(BaseModel):
    dish: str = Short
    ingredients: List[Ingredient] = Field(max_length=3)
    vegetarian: bool


class Matrix(BaseModel):
    rows: List[List[int]] = Field(max_length=3)


class Ticket(BaseModel):
    priority: Literal["low", "medium", "high"]
    summary: str = Field(max_length=40)
    assignee: Optional[Person]


class Weather(BaseModel):
    city: str = Short
    celsius: float
    conditions: List[Literal["sunny", "cloudy", "rain", "snow", "wind"]] = Field(max_length=3)


class Country(BaseModel):
    name: str = Short
    capital: str = Short
    population_millions: float


class Pair(BaseModel):
    first: Country
    second: Country


cases = [
    (Point, "Give a point with x=3 and y=4."),
    (Person, "Invent a person."),
    (PersonWithAddress, "Invent a person living in Berlin."),
    (Tags, "Give tags for a blog post about Rust."),
    (Shape, "Describe a small circle."),
    (Paint, "Describe a glossy red paint."),
    (MaybeEmail, "A user named Ann without an email address."),
    (Polygon, "A triangle's corner points."),
    (Book, "A famous novel."),
    (Library, "A library with two books."),
    (MathAnswer, "What is 12 + 30? Show steps."),
    (Flag, "Is the feature enabled? Yes."),
    (Scores, "Five test scores out of 100."),
    (Event, "A team meeting on tuesday."),
    (Rgb, "The color orange in RGB."),
    (Theme, "A dark color theme."),
    (Recipe, "A simple pancake recipe."),
    (Matrix, "The 2x2 identity matrix."),
    (Ticket, "A high priority bug report about login failures."),
    (Weather, "The weather in Oslo today."),
    (Pair, "France and Germany."),
    (Country, "Japan."),
]
parsed = []
for cls, prompt in cases:
    r = schema_client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": prompt}], response_format=cls, temperature=0,
        max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "stop", (cls.__name__, c)
    obj = c.message.parsed
    assert isinstance(obj, cls), (cls.__name__, c.message.content)
    # Round trip through the schema's own validation.
    cls.model_validate_json(c.message.content)
    parsed.append({"schema": cls.__name__, "value": obj.model_dump(mode="json")})
out["parsed"] = parsed

# An invalid schema is a 400 the SDK raises as BadRequestError, naming response_format.
try:
    schema_client.chat.completions.create(model=model, messages=question, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    raise AssertionError("invalid schema accepted")
except openai.BadRequestError as e:
    out["bad_schema"] = {"status": e.status_code, "param": e.body.get("param") if isinstance(e.body, dict) else None}

print(json.dumps(out))
