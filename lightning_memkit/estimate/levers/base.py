"""What a lever is: one way to trade step time (or numerics) for memory, as the planner, the estimator, the YAML
writer and ``MemoryBudget`` see it.

A :class:`Lever` holds no state: its choices are plain values (a string, a bool, an int), a
:class:`~lightning_memkit.estimate.levers.plan.Plan` maps each registered lever's name to one of them. A lever
says, for its choices: their order of strength (:meth:`Lever.strength`, larger lowers memory more), which ones a
run may try (:meth:`Lever.options`), how one enters the fake step (:meth:`Lever.to_step`, onto a
:class:`StepSpec`), how one is written as a LightningCLI fragment for each kind of run (``write_hf``,
``write_config``, ``write_module`` onto a :class:`Written`), how one is read from and applied to a live Trainer
(:meth:`Lever.read_trainer`, :meth:`Lever.apply`, through a :class:`TrainerEdit`), its words in a plan line
(:meth:`Lever.words`) and its cost in the step time model (:meth:`Lever.work`, :meth:`Lever.scale_cost`).

Example (a lever's choices and words)::

    >>> from lightning_memkit.estimate.levers.recompute import RECOMPUTE
    >>> RECOMPUTE.name, [RECOMPUTE.strength(c) for c in (None, "selective", "full")]
    ('recompute', [0, 1, 2])
    >>> RECOMPUTE.words("full", None)
    'full activation checkpointing'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit.estimate.step_spec import StepSpec

__all__ = ["KINDS", "Lever", "StepCost", "StepSpec", "TrainerEdit", "Written", "find_callback"]

KINDS = ("work", "free", "scale")  # adds work (ordered by it) / lowers memory for free / changes the device count


@dataclass(frozen=True)
class StepCost:
    """An optimizer step's time in the step time model, in seconds: the micro-batches' forward and backward
    (``micro``), what runs once per optimizer step (``once``: ``optimizer.step()``), the host-link copies (``link``).

    >>> StepCost(1.0, 0.25).replace(micro=2.0).seconds
    2.25
    """

    micro: float
    once: float = 0.0
    link: float = 0.0

    @property
    def seconds(self) -> float:
        return self.micro + self.once + self.link

    def replace(self, **changes: float) -> StepCost:
        return StepCost(**{**self.__dict__, **changes})

    def scaled(self, factor: float) -> StepCost:
        return StepCost(self.micro * factor, self.once * factor, self.link * factor)


@dataclass
class Written:
    """A plan written as LightningCLI settings: trainer keys in the order written, callback entries, the data
    module's batch size (``None``: unchanged)."""

    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: list[dict[str, Any]] = field(default_factory=list)
    batch_size: int | None = None


@dataclass
class TrainerEdit:
    """What :meth:`Lever.apply` may touch when ``MemoryBudget`` applies a plan to a live Trainer: the Trainer, the run
    planned (its ``batch_size``), the ``MicroBatchSplit`` the budget owns; it collects the callbacks to add and says
    each change in one line."""

    trainer: Any
    run: Any
    split: Any
    say: Callable[[str], None]
    plan: Any = None  # the plan applied (a lever whose callback another lever's carries reads it)
    added: list[Any] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)

    def find(self, class_path: str) -> Any:
        """The Trainer's callback of the class ``class_path`` names (subclasses too), or ``None``."""
        return find_callback(self.trainer, class_path)

    def change(self, line: str) -> None:
        self.changes.append(line)
        self.say(line)


def find_callback(trainer: Any, class_path: str) -> Any:
    """``trainer``'s callback of the class ``class_path`` names (subclasses too), or ``None``."""
    from lightning_memkit.common.class_paths import import_object

    cls = import_object(class_path)
    return next((c for c in trainer.callbacks if isinstance(c, cls)), None)


class Lever:
    """One lever; subclasses set the class attributes and override what applies to them (the defaults: one
    choice, no words, no effect).

    Attributes:
        name: the plan's key, the word ``allow`` and the command line use.
        kind: ``"work"`` (its stronger choices add work: recomputation, accumulation steps, dequantization; the
            search tries the least work first), ``"free"`` (lowers memory without adding work: tried strongest first)
            or ``"scale"`` (more devices: searched apart).
        keeps_math: whether every choice trains the same model on the same samples (same losses).
        between_steps: whether ``MemoryBudget`` may change it between steps of a run.
        callback: the class path of the callback carrying the lever's choice in a Trainer or a config (``None``:
            another setting carries it).
        wraps_module: whether that callback wraps the module (``MemoryBudget`` takes it off while it copies the
            module for an estimate).
        default: the choice of a run that does not pull the lever.
        opt_in: whether a run that allows every lever (``memkit estimate``) leaves this one out unless named.
        reorders_only: whether its choices run the same ops in another order (a ``"free"`` lever that never adds to
            the step time model's cost: a plan without it costs at least as much as the same plan with it).
        runs_sharded: whether its choices other than the default run with the parameters sharded (FSDP2); a plan
            that shards with one that does not is not tried.
        host_choices: the choices that keep bytes in host memory (a plan over the host memory may fit without them).
    """

    name = ""
    kind = "free"
    keeps_math = True
    between_steps = False
    callback: str | None = None
    wraps_module = False
    opt_in = False
    reorders_only = False
    runs_sharded = True
    host_choices: tuple[Any, ...] = ()
    default: Any = None

    def strength(self, choice: Any) -> int:
        """How much ``choice`` lowers memory (larger: more); choices of equal strength are interchangeable."""
        return 0

    def options(self, base: Any, run: Any) -> list[Any]:
        """The choices ``run`` may try, ``base`` (the run as given) first, then stronger ones."""
        return [base]

    def unavailable(self, run: Any) -> str | None:
        """Why ``run`` cannot pull this lever at all (one line), or ``None``."""
        return None

    def conflicts(self, plan: Any, run: Any) -> bool:
        """Whether ``plan``'s choice of this lever cannot go with its other choices (the plan is not tried)."""
        return False

    def work(self, choice: Any, base: Any) -> float:
        """The work ``choice`` adds over ``base`` in the search's order (``kind == "work"`` only)."""
        return float(self.strength(choice))

    def words(self, choice: Any, base: Any) -> str | None:
        """What ``choice`` changes from ``base``, in words (``None``: nothing to say)."""
        return None

    def scale_cost(self, choice: Any, base: Any, cost: StepCost, run: Any, est: Any = None,
                   machine: Any = None) -> StepCost:
        """The step time model's cost of a plan with ``choice`` from ``cost``, that of its fake step (``est``, priced
        with ``machine``'s balance)."""
        return cost

    def devices(self, choice: Any) -> int:
        """How many devices ``choice`` needs (a ``"scale"`` lever's choices; the others run on the devices given)."""
        return 1

    def to_step(self, choice: Any, spec: StepSpec) -> None:
        """Set ``choice`` on the fake step: its settings, patches, model transforms, optimizer wrappers or world."""

    def write_hf(self, plan: Any, run: Any, out: Written) -> None:
        """Write ``plan``'s choice for an HF-config run (a fragment of the user's trainer config)."""

    def write_config(self, plan: Any, run: Any, out: Written) -> None:
        """Write ``plan``'s choice as the edit of a LightningCLI config run's settings."""

    def write_module(self, plan: Any, run: Any, out: Written) -> None:
        """Write ``plan``'s choice, where it differs from the run as built, for a module run."""

    def read_trainer(self, trainer: Any) -> Any:
        """The choice a live Trainer runs with (the default: the lever's ``default``, a Trainer not pulling it)."""
        return self.default

    def read_config(self, trainer: dict[str, Any]) -> Any:
        """The choice a parsed config's ``trainer`` section runs with (``None``: read by the config's estimate
        itself, :func:`~lightning_memkit.estimate.config.config_features`)."""
        return None

    def apply(self, choice: Any, base: Any, edit: TrainerEdit) -> None:
        """Make the Trainer of ``edit`` run ``choice`` instead of ``base``."""
        raise NotImplementedError(f"the {self.name} lever is not applied to a running Trainer")

    def __repr__(self) -> str:
        return f"<lever {self.name}>"
