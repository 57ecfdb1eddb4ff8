"""instructor against one OpenAI-compatible server, for bench.clients: run by .venv-lmeval's
python (instructor pins a jiter the dev venv's openai release does not allow), as a script:

    .venv-lmeval/bin/python bench/clients_instructor.py BASE_URL API_KEY MODEL

Prints one JSON object: feature -> "" (passed) or what failed. Imports nothing of llmesh.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import instructor
import openai
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def features(base_url: str, api_key: str, model: str) -> dict[str, Callable[[], None]]:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "Name a city in France and its country."}]

    def with_mode(mode: instructor.Mode) -> Callable[[], None]:
        def run() -> None:
            patched = instructor.from_openai(client, mode=mode)
            city = patched.chat.completions.create(
                model=model, response_model=City, messages=ask, max_tokens=48, max_retries=0, temperature=0
            )
            assert isinstance(city, City) and city.name, city

        return run

    return {
        "instructor.tools": with_mode(instructor.Mode.TOOLS),
        "instructor.json_schema": with_mode(instructor.Mode.JSON_SCHEMA),
    }


def main() -> None:
    base_url, api_key, model = sys.argv[1:4]
    outcome = {}
    for name, run in features(base_url, api_key, model).items():
        try:
            run()
            outcome[name] = ""
        except Exception as exc:  # every failure is a finding, reported by name
            outcome[name] = f"{type(exc).__name__}: {exc}"[:500]
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
