"""The planner keeps its answers: every estimate benchmark case's predicted peak byte for byte, and the same plans
tried, estimated and chosen by each search of ``plan_table.py`` (HF configs, LightningCLI configs, modules as
built, at two budgets each), against ``plan_table.json``, the table the planner gave before its levers moved onto
one protocol."""

import json
from pathlib import Path

import plan_table
import pytest

SAVED = Path(__file__).with_name("plan_table.json")


def _differences(saved, now, path="") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        out = [f"{path}/{k}: missing now" for k in saved if k not in now]
        out += [f"{path}/{k}: new" for k in now if k not in saved]
        for k in saved.keys() & now.keys():
            out += _differences(saved[k], now[k], f"{path}/{k}")
        return out
    if isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now):
        return [d for i, (a, b) in enumerate(zip(saved, now)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if saved == now else [f"{path}: {saved!r} before, {now!r} now"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(plan_table.PARTS))
def test_the_planner_gives_the_table_it_gave_before(name):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    saved = json.loads(SAVED.read_text())
    now = plan_table.part(name)
    if "searches" in now:  # this part's searches, and only they
        saved = {"searches": {k: v for k, v in saved["searches"].items() if k in now["searches"]}}
        assert saved["searches"], f"no saved search of the {name}"
    else:
        saved = {"estimates": saved["estimates"]}
    differences = _differences(saved, now)
    assert not differences, "\n".join(differences[:20])
