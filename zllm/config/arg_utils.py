"""Command-line flags generated from dataclass fields.

An option is declared once, as a field made by `option(...)` that carries its help text;
`add_dataclass_args` turns each such field into a flag (`max_num_seqs` -> `--max-num-seqs`,
default from the field) and `dataclass_from_args` builds the dataclass back from the parsed
flags. The Python API (`LLM(model, **kwargs)`) and the CLI thus share one declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_FLAG = "zllm.flag"  # the key of a field's `Flag` in its dataclass metadata


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one dataclass field appears on the command line."""

    help: str
    # str -> value; default: the field's type (int, float, str; the element type of a list).
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # option strings besides --field-name
    # "append" or "extend" for a repeatable list; bools take theirs from their default.
    action: str | None = None
    nargs: str | None = None
    show_default: Callable[[Any], str] = str  # how --help prints the default


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    action: str | None = None,
    nargs: str | None = None,
    show_default: Callable[[Any], str] = str,
) -> Any:
    """A dataclass field that is also a command-line flag."""
    flag = Flag(help, parse, choices, aliases, action, nargs, show_default)
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_FLAG: flag}
    )


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The field's flag, or None for a field that is not one (such as `model`)."""
    return field.metadata.get(_FLAG)


def flag_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, *, title: str | None = None
) -> None:
    """Add a flag for every field of `cls` declared with `option`, under `title` in --help."""
    group = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = flag_of(field)
        if flag is not None:
            _add_flag(group, field, flag, hints[field.name])


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """`cls` from parsed flags; a field the parser did not define keeps its default."""
    given = vars(args)
    return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})


def check_choices(obj: Any) -> None:
    """argparse checks `choices` on the command line; this checks them for the Python API."""
    for field in dataclasses.fields(obj):
        flag, value = flag_of(field), getattr(obj, field.name)
        if flag and flag.choices and value is not None and value not in flag.choices:
            allowed = ", ".join(repr(c) for c in flag.choices)
            raise ValueError(f"{field.name} must be one of {allowed}; got {value!r}.")


def _add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    field: dataclasses.Field,
    flag: Flag,
    hint: Any,
) -> None:
    default = _default_of(field)
    names = (flag_name(field), *flag.aliases)
    text = _help(flag, default)
    if hint is bool:
        # A bool that defaults to True needs a way to turn it off: --no-<name>.
        action = argparse.BooleanOptionalAction if default else "store_true"
        parser.add_argument(*names, dest=field.name, default=default, action=action, help=text)
        return
    parser.add_argument(
        *names,
        dest=field.name,
        default=default,
        type=flag.parse or _value_type(hint),
        choices=flag.choices,
        action=flag.action,
        nargs=flag.nargs,
        help=text,
    )


def _default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    if field.default is dataclasses.MISSING:
        raise TypeError(f"{field.name}: a flag needs a default")
    return field.default


def _value_type(hint: Any) -> Callable[[str], Any]:
    """int from `int | None`, str from `list[str]`: what one command-line value parses into."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is list or origin in (types.UnionType, typing.Union) and len(args) == 1:
        return args[0]
    return hint


def _help(flag: Flag, default: Any) -> str:
    """The help text, with the default unless there is nothing to show (None, False, [])."""
    if default is None or default is False or default == []:
        return flag.help
    shown = flag.show_default(default).replace("%", "%%")  # argparse %-formats help
    return f"{flag.help} (default: {shown})"


# ---------------------------------------------------------------------------------------------
# Value parsers: each raises ArgumentTypeError with a message the user can act on.

_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (binary units; `64M`, `1.5G`, `512KiB`)."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if value and value[-1] in _SIZE_UNITS:
            return int(float(value[:-1]) * _SIZE_UNITS[value[-1]])
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of bytes with an optional K/M/G suffix, got {text!r}"
        ) from None


def format_size(num_bytes: int) -> str:
    """The shortest exact spelling `parse_size` reads back: 8388608 -> 8M."""
    for unit, scale in reversed(_SIZE_UNITS.items()):
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def unit_fraction(text: str) -> float:
    """A share: above 0, at most 1."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}")
    return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A flag whose value is a JSON object (`--speculative-config`, `--kv-transfer-config`)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def check_config_dict(name: str, value: Any, known: set[str]) -> dict[str, Any]:
    """A dict-valued option (`speculative_config`, `kv_transfer_config`) as the user gave it:
    a ValueError naming the option unless it is a dict whose keys are all `known`."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return value
