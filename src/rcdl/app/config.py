"""Experiment configs: frozen dataclasses whose fields carry their own help and checks.

Every experiment's settings are one :class:`ExperimentConfig` subclass. Each field is
declared with :func:`setting`, which records what the field means (its help text, shown by
``rcdl reproduce NAME --help``) and what it accepts; :func:`check_fields` then validates
every field in one place from its type and that record, so no experiment writes its own
validators and the command line (:mod:`rcdl.app.cli`) takes flags, defaults and help from
the same declaration. Example::

    @dataclass(frozen=True)
    class MyConfig(ExperimentConfig):
        QUICK = {"train_size": 200}
        train_size: int = setting(1000, "training images", metavar="N")
        seeds: tuple[int, ...] = setting((0,), "seeds", minimum=0, metavar="K")
        lr: float = setting(1e-3, "Adam learning rate", positive=True)

The checks by type: ``int`` is an int (not a bool) ``>= minimum`` (default 1); ``float`` is
a finite number ``> 0`` (``positive``) or ``>= 0``; ``str`` is one of ``choices`` when
given; ``bool`` is a bool; ``tuple[...]`` is non-empty, has no repeats (``unique``) and each
element is checked as above; ``X | None`` also takes ``None``. Lists (from JSON or argparse)
become tuples and paths strings, so configs compare equal. Checks across fields go in
:meth:`ExperimentConfig.check`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["DEVICES", "ExperimentConfig", "check_fields", "data_dir_setting", "device_setting",
           "field_type", "setting"]

DEVICES = ("auto", "cpu", "cuda")


def setting(
    default: Any,
    help: str,  # noqa: A002 - the word argparse uses
    *,
    minimum: float | None = None,
    positive: bool = False,
    choices: tuple[str, ...] | Mapping[str, Any] | None = None,
    unique: bool = True,
    metavar: str | None = None,
    flag_help: str | None = None,
    default_text: str | None = None,
    parse: Callable[[str], Any] | None = None,
    cli: bool = True,
) -> Any:
    """A config field: its ``default`` and ``help``, and what it accepts.

    Args:
        default: the value when not given (tuples are fine: configs are frozen).
        help: what the field means, in a line; the command line's help text.
        minimum: smallest int (default 1) or float allowed.
        positive: a float must be ``> 0`` (else ``>= 0`` or ``>= minimum``).
        choices: the allowed strings (for ``str`` or ``tuple[str, ...]`` fields).
        unique: a tuple must not repeat an element.
        metavar: the value's name in ``--help``.
        flag_help: the help of the flag when it differs from ``help`` (a bool defaulting
            to ``True`` is set by ``--no-NAME``: this says what that flag does).
        default_text: how ``--help`` states the default (e.g. ``"all 50 000"`` for None).
        parse: turns one command-line word into a value (default: the field's type).
        cli: whether the command line has a flag for it.
    """
    meta = {"help": help, "minimum": minimum, "positive": positive,
            "choices": tuple(choices) if choices is not None else None, "unique": unique,
            "metavar": metavar, "flag_help": flag_help, "default_text": default_text,
            "parse": parse, "cli": cli}  # fmt: skip
    return dataclasses.field(default=default, metadata=meta)


def device_setting() -> Any:
    """The ``device`` field every experiment has: ``"auto"`` (CUDA when available),
    ``"cpu"`` or ``"cuda"``; set by the common ``--device`` flag."""
    return setting("auto", "auto (CUDA when available), cpu or cuda", choices=DEVICES, cli=False)


def data_dir_setting() -> Any:
    """The ``data_dir`` field of an experiment that reads a data set: the folder of its files
    (``None``: ``$RCDL_DATA``, then the cache); set by the common ``--data-dir`` flag."""
    return setting(None, "folder of the data set's files", cli=False)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once per config class."""
    return typing.get_type_hints(cls)


def field_type(cls: type, name: str) -> tuple[type, bool, bool]:
    """``(element type, is a tuple, may be None)`` of field ``name`` of ``cls``."""
    hint = _type_hints(cls)[name]
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True, optional
    return hint, False, optional


def _check_value(owner: str, what: str, value: Any, kind: type, meta: Mapping[str, Any]) -> None:
    minimum = meta.get("minimum")
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{owner}: {what} must be a bool, got {value!r}")
    elif kind is int:
        low = 1 if minimum is None else minimum
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{owner}: {what} must be an int >= {low}, got {value!r}")
    elif kind is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if meta.get("positive"):
            ok, bound = number and math.isfinite(value) and value > 0, "> 0"
        else:
            low = 0 if minimum is None else minimum
            ok, bound = number and math.isfinite(value) and value >= low, f">= {low}"
        if not ok:
            raise ValueError(f"{owner}: {what} must be a finite number {bound}, got {value!r}")
    elif kind is str:
        choices = meta.get("choices")
        if not isinstance(value, str) or (choices and value not in choices):
            known = f"one of {list(choices)}" if choices else "a string"
            raise ValueError(f"{owner}: {what} must be {known}, got {value!r}")


def _singular(name: str) -> str:
    """``"seeds"``: ``"seed"``; ``"capacities"``: ``"capacity"``."""
    return name[:-3] + "y" if name.endswith("ies") else name.removesuffix("s")


def _check_tuple(owner: str, name: str, values: tuple, kind: type,
                 meta: Mapping[str, Any]) -> None:  # fmt: skip
    choices, one = meta.get("choices"), _singular(name)
    if not values:
        what = f"of {name}: {', '.join(choices)}" if choices else one
        raise ValueError(f"{owner}: give at least one {what}")
    if choices:
        unknown = [v for v in values if v not in choices]
        if unknown:
            raise ValueError(f"{owner}: unknown {name} {unknown}; known: {', '.join(choices)}")
    if meta.get("unique", True) and len(set(values)) != len(values):
        raise ValueError(f"{owner}: {name} must not repeat, got {list(values)}")
    for value in values:
        if not (value is None and kind is float):  # a float tuple may hold None (τ sweeps)
            _check_value(owner, f"each {one}", value, kind, {**meta, "choices": None})


def check_fields(config: Any) -> None:
    """Normalise (lists to tuples, paths to strings) and check every field of ``config``
    from its type and :func:`setting` record; ``ValueError`` names the class and field."""
    cls, owner = type(config), type(config).__name__
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind, is_tuple, optional = field_type(cls, f.name)
        meta = f.metadata
        if is_tuple and value is not None:
            value = tuple(value)
            object.__setattr__(config, f.name, value)
        elif kind is str and isinstance(value, os.PathLike):
            value = os.fspath(value)
            object.__setattr__(config, f.name, value)
        if value is None:
            if optional:
                continue
            raise ValueError(f"{owner}: {f.name} must be given, got None")
        if is_tuple:
            _check_tuple(owner, f.name, value, kind, meta)
        elif dataclasses.is_dataclass(kind):
            continue  # a nested config checks itself
        else:
            _check_value(owner, f.name, value, kind, meta)


@dataclass(frozen=True)
class ExperimentConfig:
    """The base of every experiment's settings: checked on construction, with the scales
    ``quick()`` (a smoke test, :attr:`QUICK`) and, where one exists, ``paper()``
    (:attr:`PAPER`), and ``from_dict`` for a saved ``config.json``."""

    QUICK: ClassVar[Mapping[str, Any]] = {}
    PAPER: ClassVar[Mapping[str, Any] | None] = None

    def __post_init__(self) -> None:
        check_fields(self)
        self.check()

    def check(self) -> None:
        """Checks across fields, after every field passed its own (override)."""

    @classmethod
    def quick(cls, **overrides: Any) -> Any:
        """The smoke-test scale (:attr:`QUICK`), with ``overrides`` on top."""
        return cls(**{**cls.QUICK, **overrides})

    @classmethod
    def paper(cls, **overrides: Any) -> Any:
        """The paper's scale (:attr:`PAPER`), with ``overrides`` on top."""
        if cls.PAPER is None:
            raise ValueError(f"{cls.__name__} has no paper scale")
        return cls(**{**cls.PAPER, **overrides})

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> Any:
        """The config saved as ``config.json``; settings it does not know are an error."""
        unknown = set(saved) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown settings {sorted(unknown)}")
        return cls(**saved)
