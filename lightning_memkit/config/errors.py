"""Configuration mistakes in one line: :class:`ConfigError` and the words for a parser's or constructor's error.

A bad configuration value (unknown key, wrong type, bad ``class_path``, or a ``ValueError``/``TypeError``
raised by a constructor) becomes a :class:`ConfigError` naming the key and what is allowed; a ``--config``
file that is not YAML names the file, line and column (:func:`check_config_syntax`). ``memkit`` prints it on
one or two lines and exits with status 2.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lightning_memkit.common.class_paths import class_name, import_object, instantiate
from lightning_memkit.common.errors import ConfigError

__all__ = ["CONSTRUCTION_ERRORS",  # noqa: F822 (module __getattr__: it imports Lightning)
           "LEAF_SPEC_WARNING", "ConfigError", "check_config_syntax", "class_name", "describe_config_error",
           "describe_yaml_error"]


def __getattr__(name: str) -> Any:
    """``CONSTRUCTION_ERRORS``: the errors raised while building the objects of a configuration (not while running
    them); Lightning's ``MisconfigurationException`` among them, imported when asked for (``ConfigError`` alone
    does not import Lightning)."""
    if name == "CONSTRUCTION_ERRORS":
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        return (ValueError, TypeError, ImportError, AttributeError, MisconfigurationException)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')


_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")


_OWNER = re.compile(r"^(\w+)\((\w+)=")


_NOISE = re.compile(
    r"^\s*(- )?(Expected a <class 'NoneType'>|Given value|Subtypes:|Does not validate|Errors:|Not a valid subclass"
    r"|Subclass types expect|- a |Problem with given class_path|Parser key)"
)


LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes, outermost first."""
    out: list[BaseException] = []
    while err is not None and all(err is not e for e in out):
        out.append(err)
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return out


def _root_message(err: BaseException) -> str:
    """The meaningful lines of ``err`` on one line, jsonargparse's union bookkeeping dropped."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not _NOISE.match(ln)]
    text = " ".join(lines) or type(err).__name__
    text = re.sub(r"Expected an? <class '([\w.]+)'>", r"expected \1", text)
    return re.sub(r"<class '([\w.]+)'>", r"\1", text)


def _init_args(class_path: str) -> list[str]:
    """Names of the ``__init__`` arguments of ``class_path`` (empty where it cannot be imported)."""
    import inspect

    try:
        cls = import_object(class_path)
        params = inspect.signature(cls.__init__).parameters.values()
    except Exception:  # noqa: BLE001 - only a hint in an error message
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _owner_key(config: Any, class_name: str, prefix: str = "") -> str | None:
    """Dotted path in ``config`` (nested dicts/lists) of the entry whose ``class_path`` names ``class_name``."""
    if isinstance(config, dict):
        path = config.get("class_path")
        if isinstance(path, str) and path.rpartition(".")[2] == class_name:
            return prefix
        items = config.items()
    elif isinstance(config, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(config))
    else:
        return None
    for k, v in items:
        key = f"{prefix}{k}" if str(k).startswith("[") else f"{prefix}.{k}" if prefix else str(k)
        found = _owner_key(v, class_name, key)
        if found is not None:
            return found
    return None


def describe_config_error(err: BaseException, config: Any = None) -> str:
    """One line naming the configuration key behind ``err`` and what went wrong (see :class:`ConfigError`).

    ``config``: the parsed configuration as nested dicts, to find the key of a class whose constructor raised.
    """
    chain = _chain(err)
    outer = str(chain[0])
    keys = list(dict.fromkeys(_PARSER_KEY.findall(outer)))
    root = _root_message(chain[-1])
    class_path = next((m.group(1) for e in chain if (m := _CLASS_PATH.search(str(e)))), None)
    if class_path and "is not accepted" in root:
        accepted = _init_args(class_path)
        root += f" by {class_path}" + (f"; accepted: {', '.join(accepted)}" if accepted else "")
    elif class_path and isinstance(chain[-1], (ImportError, AttributeError)):
        root = f"class_path {class_path!r} cannot be imported: {root}"
        if isinstance(chain[-1], ModuleNotFoundError):
            root += f" (modules are found on the Python path, which starts with the working directory {os.getcwd()})"
    key = ".".join(keys)
    if key == "trainer.precision" and (got := re.search(r"Got value: (.+)", root)):
        return f"trainer.precision: {got.group(1).strip()!r} is not a precision; accepted: {', '.join(precisions())}"
    if root == type(chain[-1]).__name__ and config is not None:  # the message was lost in a union's bookkeeping
        found = failing_entry(config)
        if found is not None:
            return found
    owner = _OWNER.match(root)
    if not key and owner and config is not None:
        found = _owner_key(config, owner.group(1))
        key = f"{found}.init_args.{owner.group(2)}" if found else ""
    return f"{key}: {root}" if key else root


def precisions() -> list[str]:
    """The ``Trainer(precision=...)`` values Lightning accepts, as written in a config.

    Example::

        >>> {"bf16-true", "16-mixed", "32"} <= set(precisions())
        True
    """
    from typing import Literal, get_args, get_origin

    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT

    def literals(hint: Any) -> list[str]:
        if get_origin(hint) is Literal:
            return [str(v) for v in get_args(hint)]
        return [v for arg in get_args(hint) for v in literals(arg)]

    return list(dict.fromkeys(literals(_PRECISION_INPUT)))


def trainer_entries(config: Any, section: str) -> list[tuple[int, dict[str, Any]]]:
    """``(index, entry)`` of the ``class_path`` entries of ``trainer.<section>`` in ``config`` (nested dicts, as
    parsed; a single entry counts as a list of one)."""
    trainer = config.get("trainer") if isinstance(config, dict) else None
    entries = trainer.get(section) if isinstance(trainer, dict) else None
    entries = [entries] if isinstance(entries, dict) else entries or []
    return [(i, e) for i, e in enumerate(entries) if isinstance(e, dict) and isinstance(e.get("class_path"), str)]


def failing_entry(config: Any) -> str | None:
    """``"key: message"`` of the first of the trainer's plugins and callbacks in ``config`` (nested dicts, as parsed)
    whose constructor raises, constructed again to recover the message that a union type's validation dropped
    (they are cheap to construct, unlike the model and the data); ``None`` when all construct."""
    for section in ("plugins", "callbacks"):
        for i, entry in trainer_entries(config, section):
            try:
                instantiate(entry)
            except Exception as err:  # noqa: BLE001 - the error being described
                message = _root_message(err)
                owner = _OWNER.match(message)
                key = f"trainer.{section}[{i}]" + (f".init_args.{owner.group(2)}" if owner else "")
                return f"{key}: {message}"
    return None


def check_config_syntax(args: Any) -> None:
    """Refuse a ``--config``/``-c`` file of the command line ``args`` that is not YAML: a one-line
    :class:`ConfigError` naming the file, line and column (the parser's own message names ``"<unicode string>"``).
    Anything but a list of strings, and config values that are not files, are left to the parser."""
    if not isinstance(args, (list, tuple)):
        return
    args = [str(a) for a in args]
    given = [value for flag, value in zip(args, args[1:], strict=False) if flag in ("--config", "-c")]
    given += [a.partition("=")[2] for a in args if a.startswith("--config=")]
    for path in (p for p in given if os.path.isfile(p)):
        _check_yaml_file(path)


def _check_yaml_file(path: str) -> None:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):  # the parser's error names the file
        return
    try:
        yaml.compose(text, Loader=yaml.SafeLoader)  # syntax only: nothing constructed
    except yaml.MarkedYAMLError as err:
        raise ConfigError(describe_yaml_error(path, err), hint=False) from err


def describe_yaml_error(path: str, err: Any) -> str:
    """One line for a ``yaml.MarkedYAMLError`` of the file ``path``: file, line, column, problem and context.

    Example::

        >>> import yaml
        >>> from lightning_memkit.config.errors import describe_yaml_error
        >>> try:
        ...     yaml.safe_load("a: [1, 2")
        ... except yaml.MarkedYAMLError as err:
        ...     print(describe_yaml_error("b.yaml", err))
        --config b.yaml: invalid YAML at line 1, column 9: ... (while parsing a flow sequence at line 1, column 4)
    """
    if err.problem:
        what = err.problem + (f" ({err.context}{_at(err.context_mark)})" if err.context else "")
        where = _at(err.problem_mark or err.context_mark)
    else:
        what, where = str(err.context), _at(err.context_mark)
    return f"--config {path}: invalid YAML{where}: {' '.join(what.split())}"


def _at(mark: Any) -> str:
    """`` at line L, column C`` (1-based) of a yaml ``Mark``; empty for ``None``."""
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
