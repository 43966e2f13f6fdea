"""The memory each recipe of ``examples/configs/recipes/`` was planned for: every ``memkit estimate --budget``
command its header names (between backticks), run on the published dimensions of its model
(``examples/hf_configs/``), for a CUDA device, each search in a fresh interpreter on this machine.

One entry per command: the run as given, every plan found (levers, device peak, host bytes, predicted step time),
the search's counts and time, and the first plan's YAML. Goal: a plan on one device within the budget (a header may
also name a budget no plan fits: that entry says NOT met). ``tests/finetune/test_recipes.py`` checks that each
recipe's header states these figures. Predictions (estimates on fake tensors), not measured steps: no GPU is used.

    python -m benchmarks.run --only recipes --device cpu
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from benchmarks.bench_plans_8b import plan_entry

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "configs" / "recipes"
COMMAND = re.compile(r"`memkit estimate ([^`]+)`")
QUICK = {"4096": "1024"}


def header(recipe: Path) -> str:
    """The comment lines at the top of ``recipe``, joined into one line."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return " ".join(lines)


def planned_for(recipe: Path) -> list[tuple[str, ...]]:
    """The arguments of each ``memkit estimate`` command in ``recipe``'s header (at least one, with ``--budget``)."""
    commands = [tuple(shlex.split(m)) for m in COMMAND.findall(header(recipe))]
    if not commands or any("--budget" not in c for c in commands):
        raise ValueError(f"{recipe}: its header must name the `memkit estimate ... --budget B` command it was "
                         f"planned with; found {commands}")
    return commands


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: these are estimates made on this machine for a CUDA device; run it "
                         "with --device cpu")
    cases = [(recipe.name, args) for recipe in sorted(RECIPES.glob("*.yaml")) for args in planned_for(recipe)]
    if quick:  # the first command at a quarter of its tokens
        cases = [(f"{cases[0][0]} (--quick)", tuple(QUICK.get(a, a) for a in cases[0][1]))]
    return [plan_entry("recipes", label, args) for label, args in cases]
