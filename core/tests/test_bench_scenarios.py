"""`verispec bench --scenario FILE.json`: scenarios of the user's own, read and checked before a
model loads (verispec.bench.run.load_scenarios / read_scenario_file)."""
import json
from pathlib import Path

import pytest

from verispec.bench.run import load_scenarios, read_scenario_file
from verispec.errors import InvalidArgument

HELDOUT = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout_prompts.json"


def _write(tmp_path, data, name="mine.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_a_file_of_one_scenario_or_a_list_mixes_with_bundled_names_in_order(tmp_path):
    one = _write(tmp_path, {"name": "mine", "prompt": "Say hi.\n", "max_new_tokens": 8}, "one.json")
    two = _write(tmp_path, [{"name": "a", "prompt": "A\n", "max_new_tokens": 4, "kind": "copy"},
                            {"name": "b", "turns": ["B\n", "again\n"], "max_new_tokens": 5}], "two.json")
    got = load_scenarios(["prose", one, two])
    assert [s["name"] for s in got] == ["prose", "mine", "a", "b"]
    assert [s["kind"] for s in got[1:]] == ["custom", "copy", "custom"]  # "custom" unless given
    assert got[3]["turns"] == ["B\n", "again\n"] and got[1]["max_new_tokens"] == 8


@pytest.mark.parametrize("data, message", [
    ("{not json", "not JSON"),
    ([], "an empty list"),
    (["text"], "a str; each scenario is a JSON object"),
    ({"prompt": "x", "max_new_tokens": 3}, '"name" must be a non-empty string'),
    ({"name": "n", "max_new_tokens": 3}, 'give "prompt"'),
    ({"name": "n", "turns": ["ok", ""], "max_new_tokens": 3}, 'give "prompt"'),
    ({"name": "n", "prompt": "x", "max_new_tokens": 0}, '"max_new_tokens" must be an integer >= 1, not 0'),
    ({"name": "n", "prompt": "x", "max_new_tokens": True}, '"max_new_tokens" must be an integer >= 1'),
    ({"name": "n", "prompt": "x", "max_new_tokens": 3, "kind": 7}, '"kind" must be a string'),
])
def test_a_bad_file_names_the_file_the_scenario_and_the_field(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(InvalidArgument, match=message) as e:
        load_scenarios([path])
    assert f"--scenario {path}" in str(e.value)


def test_a_missing_file_and_an_unknown_name_are_named(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot read it"):
        read_scenario_file(str(tmp_path / "absent.json"))
    with pytest.raises(InvalidArgument, match=r"unknown scenario\(s\) \['nope'\].*FILE.json"):
        load_scenarios(["prose", "nope"])


def test_the_held_out_prompt_set_reads():
    """benchmarks/heldout_prompts.json: the cost model's held-out prompts (docs/benchmarks.md)."""
    scenarios = read_scenario_file(str(HELDOUT))
    assert len(scenarios) >= 8 and len({s["name"] for s in scenarios}) == len(scenarios)
