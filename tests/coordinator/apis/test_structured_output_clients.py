"""Unchanged clients get structured output: the openai SDK's `parse`, LangChain's `with_structured_output`
and `bind_tools(tool_choice=...)`, against a real cluster whose model would otherwise answer gibberish."""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.system

LONG = {"maxIterTimes": 1000, "maxSeqLen": 2048, "maxInputTokenLen": 1024}


class City(BaseModel):
    """A city and its size."""

    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=5000)
    coastal: bool


class GetWeather(BaseModel):
    """Weather in a city."""

    city: Literal["Oslo", "Paris", "Lima"]
    unit: Literal["C", "F"]


@pytest.fixture(scope="module")
def url(shared_coordinator) -> str:
    return shared_coordinator(**LONG).address


def test_openai_sdk_parse_returns_the_pydantic_model(url):
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    completion = sdk.chat.completions.parse(model="pdserve-tiny", response_format=City, temperature=0,
                                            messages=[{"role": "user", "content": "Name a city."}])
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)


def test_openai_sdk_parse_with_a_strict_tool_forces_a_valid_call(url):
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    completion = sdk.chat.completions.parse(
        model="pdserve-tiny", temperature=0, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_langchain_with_structured_output_json_schema(url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="pdserve-tiny", base_url=url + "/v1", api_key="unused", temperature=0, max_retries=0)
    city = llm.with_structured_output(City, method="json_schema").invoke("Name a city.")
    assert isinstance(city, City)


def test_langchain_bind_tools_with_a_named_tool_choice(url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="pdserve-tiny", base_url=url + "/v1", api_key="unused", temperature=0.7, seed=5,
                     max_retries=0)
    message = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Lima?")
    assert [call["name"] for call in message.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(message.tool_calls[0]["args"])
