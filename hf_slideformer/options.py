"""The settings table: what each option of the engine accepts, its help, and where users write it.

Every `SlideConfig` field is declared with `option(...)`: a default, a help text and a `Kind`
(the type and range it accepts). That declaration is the only list of settings: `SlideArgs`
(`slide_<name>` on the Trainer's command line) and `SlidePlugin` (the `slideformer:` mapping of
the Accelerate yaml) get their fields from it through `option_fields`, check their values with
`check_fields`, and `docs/options.md` is rendered from it (`python -m hf_slideformer.options_doc`).

One rule for every surface: a value is checked by type and range before anything runs, and an
error names the field and says what to use. Strings are parsed where the type is unambiguous
(`'24'` for an int, `'0.5'` for a float, `'true'` / `'false'` for a bool), since yaml and the
command line deliver text; everything else is refused (bools for numbers, `2.5` for an int,
non-finite floats).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

__all__ = ["Kind", "Int", "Float", "Bool", "ClipNorm", "Choice", "Auto", "DType", "Device", "Directory", "Option",
           "option", "settings_of", "option_fields", "check_fields", "DTYPES", "SURFACES"]

SURFACES = ("args", "plugin")                  # SlideArgs (slide_<name>), SlidePlugin (yaml key <name>)
_INT = re.compile(r"\s*[+-]?\d+\s*")
_BOOLS = {"true": True, "false": False}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
FLOAT16_REFUSED = ("the sliding engine applies each update inside backward, so torch.amp.GradScaler can neither "
                   "unscale nor skip it (an overflow leaves the fp32 masters NaN); use bfloat16 (bf16: same memory "
                   "and speed, no loss scaling needed) or float32")


class Kind:
    """What an option accepts. `parse` returns the normalized value or raises ValueError(what to use)."""

    cli_type: type = str                         # the type `HfArgumentParser` reads from the command line

    def describe(self) -> str:
        """What the option accepts, in words, on this host (messages)."""
        raise NotImplementedError

    def doc(self) -> str:
        """What the option accepts, in words that hold on every host (docs)."""
        return self.describe()

    def parse(self, value: Any) -> Any:
        raise NotImplementedError

    def refuse(self, reason: str = "") -> ValueError:
        return ValueError(f"use {self.describe()}" + (f" ({reason})" if reason else ""))


class Int(Kind):
    """An int in [lo, hi]; `hi` may be a function (a bound the host decides). Bools and 2.5 are refused."""

    cli_type = int

    def __init__(self, lo: int = 1, hi: int | Callable[[], int] | None = None, hi_text: str = ""):
        self.lo, self.hi, self.hi_text = lo, hi, hi_text

    def bound(self) -> Optional[int]:
        return self.hi() if callable(self.hi) else self.hi

    def describe(self) -> str:
        hi = self.bound()
        if hi is None:
            return f"an int >= {self.lo}"
        return f"an int in [{self.lo}, {hi}]" + (f" ({self.hi_text})" if self.hi_text else "")

    def doc(self) -> str:
        return f"an int >= {self.lo}, {self.hi_text}" if callable(self.hi) else self.describe()

    def parse(self, value):
        if isinstance(value, str) and _INT.fullmatch(value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self.refuse()
        value, hi = int(value), self.bound()
        if value < self.lo or (hi is not None and value > hi):
            raise self.refuse()
        return value


class Float(Kind):
    """A finite number in [lo, hi] (`lo_open`: lo excluded); ints are widened, bools refused."""

    cli_type = float

    def __init__(self, lo: float | None = None, hi: float | None = None, lo_open: bool = False, unit: str = ""):
        self.lo, self.hi, self.lo_open, self.unit = lo, hi, lo_open, unit

    def describe(self) -> str:
        unit = f" ({self.unit})" if self.unit else ""
        if self.lo is not None and self.hi is not None:
            return f"a number in [{self.lo}, {self.hi}]{unit}"
        if self.lo is not None:
            return f"a number {'>' if self.lo_open else '>='} {self.lo}{unit}"
        return f"a finite number{unit}"

    def parse(self, value):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise self.refuse() from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.refuse()
        value = float(value)
        if not math.isfinite(value):
            raise self.refuse("not finite")
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        if low or (self.hi is not None and value > self.hi):
            raise self.refuse()
        return value


class ClipNorm(Kind):
    """A clipping threshold: a finite number; 0 or less turns clipping off (HF's convention)."""

    cli_type = float

    def describe(self) -> str:
        return "a finite number (> 0: clip at that norm; 0 or less: no clipping)"

    def parse(self, value):
        try:
            value = Float().parse(value)
        except ValueError:
            raise self.refuse() from None
        return value if value > 0 else None            # the one "<= 0 means off" rule


class Bool(Kind):
    """True or False; the strings 'true' / 'false' (any case) from yaml or the command line."""

    cli_type = bool

    def describe(self) -> str:
        return "True or False"

    def parse(self, value):
        if isinstance(value, str) and value.strip().lower() in _BOOLS:
            return _BOOLS[value.strip().lower()]
        if not isinstance(value, bool):
            raise self.refuse()
        return value


class Choice(Kind):
    """One of a few strings."""

    def __init__(self, *values: str):
        self.values = values

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)

    def parse(self, value):
        if value not in self.values:
            raise self.refuse()
        return value


class Auto(Kind):
    """'auto' (the engine decides) or a value of `inner`."""

    def __init__(self, inner: Kind):
        self.inner = inner

    def describe(self) -> str:
        return f"'auto' or {self.inner.describe()}"

    def doc(self) -> str:
        return f"'auto' or {self.inner.doc()}"

    def parse(self, value):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return self.inner.parse(value)
        except ValueError:
            raise self.refuse() from None


class DType(Kind):
    """A compute dtype: torch.float32 / torch.bfloat16 or a name; returns the canonical name."""

    def describe(self) -> str:
        return "'bfloat16' ('bf16') or 'float32' ('fp32'), or the torch dtype"

    def parse(self, value):
        if isinstance(value, torch.dtype):
            value = next((n for n, d in DTYPES.items() if d == value), value)
        if value not in DTYPES:
            raise self.refuse()
        dtype = DTYPES[value]
        if dtype == torch.float16:
            raise ValueError(f"float16 is refused: {FLOAT16_REFUSED}")
        return str(dtype).removeprefix("torch.")


class Device(Kind):
    """'cuda', 'cuda:N' or 'cpu' (a string or a torch.device)."""

    def describe(self) -> str:
        return "'cuda', 'cuda:N' or 'cpu'"

    def parse(self, value):
        try:
            dev = torch.device(value)
        except (RuntimeError, TypeError):
            raise self.refuse() from None
        if dev.type not in ("cuda", "cpu"):
            raise self.refuse()
        return str(dev)


def _ancestors(path: str):
    """`path` and the directories above it, nearest first."""
    while True:
        yield path
        up = os.path.dirname(path)
        if up == path:
            return
        path = up


class Directory(Kind):
    """A directory path. It may be created, one level deep: its parent must exist (no `mkdir -p`)."""

    def describe(self) -> str:
        return "a directory whose parent exists"

    def parse(self, value):
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise self.refuse()
        path = os.path.abspath(os.path.expanduser(os.fspath(value)))
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{path} is a file, not a directory: name a directory")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            blocker = next((p for p in _ancestors(parent) if os.path.exists(p)), None)
            if blocker is not None and not os.path.isdir(blocker):
                raise ValueError(f"{path} cannot be a directory: {blocker} is a file, not a directory. Name a "
                                 "directory elsewhere (on a fast local disk)")
            raise ValueError(f"{parent} does not exist: create it first (mkdir -p {path}) or name an existing "
                             "directory; it is not created for you")
        return os.fspath(value)


@dataclass(frozen=True)
class Option:
    """One setting: its `Kind`, help and default, where users write it, and what None means.

    Attributes:
        name: the `SlideConfig` field (`slide_<name>` in SlideArgs, `<name>` in the yaml).
        kind: what it accepts.
        help: what it does (one text for every surface and the docs).
        default: the default value.
        none: what None means; "" when None is not accepted.
        surfaces: where users write it besides `SlideConfig`: "args" (SlideArgs), "plugin" (yaml).
        elsewhere: for a surface that lacks it, where that surface takes it from (docs).
    """

    name: str
    kind: Kind
    help: str
    default: Any = None
    none: str = ""
    surfaces: tuple = SURFACES
    elsewhere: str = ""

    def check(self, value: Any, label: str) -> Any:
        """The normalized `value`, or ValueError naming `label` and saying what to use."""
        if value is None:
            if self.none:
                return None
            raise ValueError(f"{label}=None: {self.kind.refuse().args[0]}")
        try:
            return self.kind.parse(value)
        except ValueError as e:
            alt = f", or None ({self.none})" if self.none and str(e).startswith("use ") else ""
            raise ValueError(f"{label}={value!r}: {e}{alt}") from None

    @property
    def annotation(self) -> Any:
        """The field type of a derived dataclass (what `HfArgumentParser` reads)."""
        return Optional[self.kind.cli_type] if self.none else self.kind.cli_type

    def accepts(self) -> str:
        """What the option accepts, in words, None included."""
        return self.kind.doc() + (f"; None: {self.none}" if self.none else "")


def option(default: Any, kind: Kind, help: str, *, none: str = "", surfaces: tuple = SURFACES,
           elsewhere: str = "") -> Any:
    """A dataclass field declared as a setting (name filled in from the field by `settings_of`)."""
    spec = Option("", kind, help, default, none, tuple(surfaces), elsewhere)
    return field(default=default, metadata={"help": help, "option": spec})


def settings_of(cls: type) -> dict[str, Option]:
    """The settings table of dataclass `cls`: field name -> `Option`, in field order."""
    out = {}
    for spec in dataclasses.fields(cls):
        if "option" not in spec.metadata:
            raise TypeError(f"{cls.__name__}.{spec.name} is not declared with option(...)")
        out[spec.name] = dataclasses.replace(spec.metadata["option"], name=spec.name)
    return out


def option_fields(settings: dict[str, Option], surface: str, prefix: str = "") -> Callable[[type], type]:
    """Class decorator, applied under `@dataclass`: one field `<prefix><name>` per option of `surface`.

    Each field keeps the option's default and help, and a type `HfArgumentParser` understands.
    """
    def add(cls: type) -> type:
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for opt in settings.values():
            if surface in opt.surfaces:
                annotations[prefix + opt.name] = opt.annotation
                # argparse formats help texts with %: a literal one is doubled (HfArgumentParser's --help).
                setattr(cls, prefix + opt.name, field(default=opt.default,
                                                      metadata={"help": opt.help.replace("%", "%%")}))
        cls.__annotations__ = annotations
        return cls
    return add


def check_fields(obj: Any, settings: dict[str, Option], surface: str, prefix: str = "", label: str = "{}") -> None:
    """Check and normalize, in place, the fields `option_fields` gave `obj` (ValueError naming the field)."""
    for opt in settings.values():
        if surface in opt.surfaces:
            attr = prefix + opt.name
            setattr(obj, attr, opt.check(getattr(obj, attr), label.format(attr)))
