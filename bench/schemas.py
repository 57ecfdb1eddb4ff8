"""The JSON Schemas structured answers are checked on (tests and `python -m bench.structured`):
nested objects, arrays with bounds, enums, numbers with ranges, patterns, and free strings with no
length bound, each with a question a user would ask for it."""

from __future__ import annotations

from typing import Any

STRING: dict[str, Any] = {"type": "string"}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Name a city.", {"type": "object", "properties": {"city": STRING}, "required": ["city"]}),
    (
        "Describe a person.",
        {
            "type": "object",
            "properties": {"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "Give three tags for a blog post about cooking.",
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": STRING, "minItems": 3, "maxItems": 3}},
            "required": ["tags"],
        },
    ),
    (
        "What is the sentiment of 'I love it'?",
        {
            "type": "object",
            "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
            "required": ["sentiment"],
        },
    ),
    (
        "Rate this movie from 1 to 5.",
        {
            "type": "object",
            "properties": {"score": {"type": "number", "minimum": 1, "maximum": 5}, "why": STRING},
            "required": ["score", "why"],
        },
    ),
    (
        "Give a product code.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
            "required": ["code"],
        },
    ),
    (
        "Write an address.",
        {
            "type": "object",
            "properties": {
                "address": {
                    "type": "object",
                    "properties": {
                        "street": STRING,
                        "city": STRING,
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                }
            },
            "required": ["address"],
        },
    ),
    (
        "List some numbers.",
        {"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10}, "minItems": 1, "maxItems": 5},
    ),
    ("Is the sky blue?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    (
        "Describe a book.",
        {
            "type": "object",
            "properties": {
                "title": STRING,
                "author": {"type": "object", "properties": {"first": STRING, "last": STRING}, "required": ["last"]},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            },
            "required": ["title", "author", "year"],
        },
    ),
    (
        "Summarize the news.",
        {
            "type": "object",
            "properties": {"summary": STRING, "topics": {"type": "array", "items": STRING}},
            "required": ["summary"],
        },
    ),
    (
        "Pick a color.",
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            },
            "required": ["color", "hex"],
        },
    ),
    (
        "Give a temperature reading.",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -90, "maximum": 60}, "unit": {"const": "C"}},
            "required": ["celsius", "unit"],
        },
    ),
    (
        "Plan a trip.",
        {
            "type": "object",
            "properties": {
                "days": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 7}, "plan": STRING},
                        "required": ["day", "plan"],
                    },
                    "minItems": 2,
                    "maxItems": 3,
                }
            },
            "required": ["days"],
        },
    ),
    ("Say something.", STRING),
    ("Pick a number.", {"type": "integer", "minimum": 0, "maximum": 1000}),
    (
        "Create a user account.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                "email": STRING,
                "roles": {
                    "type": "array",
                    "items": {"enum": ["admin", "editor", "viewer"]},
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["username", "email", "roles"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a recipe.",
        {
            "type": "object",
            "properties": {
                "name": STRING,
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"item": STRING, "grams": {"type": "integer", "minimum": 1, "maximum": 5000}},
                        "required": ["item", "grams"],
                    },
                    "maxItems": 4,
                },
                "steps": {"type": "array", "items": STRING, "maxItems": 4},
            },
            "required": ["name", "ingredients", "steps"],
        },
    ),
    (
        "Classify this email: 'You won a prize!'",
        {
            "type": "object",
            "properties": {
                "label": {"enum": ["spam", "ham"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["label", "confidence"],
        },
    ),
    (
        "Give coordinates of a place.",
        {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
                "name": STRING,
            },
            "required": ["lat", "lon"],
        },
    ),
    (
        "Extract the meeting details: 'Lunch with Sam on Friday at noon'.",
        {
            "type": "object",
            "properties": {
                "who": {"type": "array", "items": STRING, "minItems": 1},
                "when": {
                    "type": "object",
                    "properties": {
                        "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
                        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                    },
                    "required": ["day", "time"],
                },
                "note": STRING,
            },
            "required": ["who", "when"],
        },
    ),
    (
        "Give a nested config.",
        {
            "type": "object",
            "properties": {
                "server": {
                    "type": "object",
                    "properties": {
                        "host": STRING,
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": {
                            "type": "object",
                            "properties": {"enabled": {"type": "boolean"}},
                            "required": ["enabled"],
                        },
                    },
                    "required": ["host", "port", "tls"],
                }
            },
            "required": ["server"],
        },
    ),
]
