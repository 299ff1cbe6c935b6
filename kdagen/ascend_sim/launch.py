"""Load a generated CANNBot-DSL kernel.py with ``cannbotdsl`` bound to the model."""

from __future__ import annotations

import builtins
import types
from pathlib import Path

from . import dsl, reg


def _importer(real=builtins.__import__):
    def __import__(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 - signature of __import__
        if level == 0 and (name == "cannbotdsl" or name.startswith("cannbotdsl.")):
            sub = name.split(".", 1)[1] if "." in name else None
            if sub is None:
                return dsl
            if sub == "reg":
                return dsl if not fromlist else reg
            if sub == "dtypes":
                return dsl if not fromlist else dsl.dtypes
            raise ImportError(f"{name}: not part of the model's DSL subset")
        return real(name, globals, locals, fromlist, level)
    return __import__


def load_kernel_module(source: Path, name: str | None = None) -> types.ModuleType:
    """Execute ``source`` (a generated kernel.py) as a fresh module whose ``cannbotdsl`` is the model.

    The module is not entered in sys.modules: every call gives an independent copy, so a test can
    load a modified kernel next to the shipped one.
    """
    source = Path(source)
    mod = types.ModuleType(f"kdagen_ascend_model.{name or source.parent.name}")
    mod.__file__ = str(source)
    b = dict(vars(builtins))
    b["__import__"] = _importer()
    mod.__dict__["__builtins__"] = b
    code = compile(source.read_text(), str(source), "exec")
    exec(code, mod.__dict__)  # noqa: S102 - the project's own generated source
    return mod
