"""Ten Pydantic models for the structured-output tests: nested objects, arrays, enums, optional fields,
bounded numbers and string patterns. Strings and arrays are bounded so a 135M model at temperature 0.8 ends
within a modest max_tokens."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    person: Person
    address: Address


class Tagged(BaseModel):
    title: str = Field(max_length=16)
    tags: list[str] = Field(max_length=3)


class Paint(BaseModel):
    color: Color
    coats: int = Field(ge=1, le=3)


class Measurement(BaseModel):
    value: float = Field(ge=-10.0, le=10.0)
    unit: Literal["m", "cm", "mm"]


class Profile(BaseModel):
    username: str = Field(pattern=r"^[a-z]{3,8}$")
    nickname: str | None = Field(default=None, max_length=10)


class Scores(BaseModel):
    scores: list[Annotated[int, Field(ge=0, le=100)]] = Field(min_length=1, max_length=4)
    passed: bool


class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{2}-[0-9]{3}$")
    price: float = Field(gt=0, le=1000)
    in_stock: bool


class Team(BaseModel):
    name: str = Field(max_length=10)
    members: list[Person] = Field(min_length=1, max_length=2)


class Event(BaseModel):
    kind: Literal["meeting", "call"]
    day: int = Field(ge=1, le=31)
    attendees: list[Color] = Field(max_length=2)


SCHEMAS: tuple[type[BaseModel], ...] = (
    Person,
    Customer,
    Tagged,
    Paint,
    Measurement,
    Profile,
    Scores,
    Product,
    Team,
    Event,
)
