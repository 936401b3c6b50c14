"""The settings base: construction validates, JSON round trips, unknown keys and wrong kinds are one line, and help
lives in field metadata (inherited where a subclass only changes a default)."""

from dataclasses import dataclass

import pytest

from crispedit.errors import CrispEditError
from crispedit.settings import Settings, setting


@dataclass
class Knobs(Settings):
    KIND = "knob config"

    size: int = setting(3, help="how big (default {default})")
    rate: float = setting(0.5, help="how fast (default {default})")
    name: str = setting("a", help=lambda cls: f"one of {cls.__name__}'s names")
    hidden: int = 0

    def validate(self) -> "Knobs":
        if self.size < 1:
            raise CrispEditError(f"size must be at least 1, got {self.size}")
        return self


@dataclass
class Bigger(Knobs):
    size: int = 10  # a new default only: the help is the base's


def test_construction_validates_and_json_round_trips():
    with pytest.raises(CrispEditError, match="size must be at least 1"):
        Knobs(size=0)
    k = Knobs(size=4, name="b")
    assert Knobs.from_dict(k.to_json()) == k
    assert Knobs.from_dict({"rate": 0.25}) == Knobs(rate=0.25)


def test_from_dict_refuses_unknown_keys_and_non_objects_in_one_line():
    with pytest.raises(CrispEditError, match="^unknown knob config keys: colour, weight$"):
        Knobs.from_dict({"weight": 1, "colour": 2})
    with pytest.raises(CrispEditError, match="knob config must be a JSON object, got list"):
        Knobs.from_dict([1, 2])


def test_help_fills_in_the_default_and_is_inherited_with_a_new_default():
    assert Knobs.help_of("size") == "how big (default 3)"
    assert Knobs.help_of("rate") == "how fast (default 0.5)"
    assert Knobs.help_of("name") == "one of Knobs's names"
    assert Knobs.help_of("hidden") == ""
    assert Bigger.help_of("size") == "how big (default 10)"
    assert [f.name for f in Bigger.described()] == ["size", "rate", "name"]
