"""Reading a ``torch.export`` program (``model.pt2``) in the server process without running
anything the file carries: model code runs in a worker, and a pytorch model is served here.

``torch.export.load`` alone would run the file's own code: it unpickles pickled weights and
constants with ``weights_only=False`` (and falls back to it when a weights-only load fails),
unpickles "opaque" constants with plain ``pickle``, loads AOTInductor's compiled libraries
from the archive, and hands each symbolic shape expression to ``sympy.sympify`` (an
``eval``). So before it runs, the archive is read once and refused when it holds compiled
code or an expression that is more than sympy constructors and literals; while it runs, any
unpickling of an object on this thread is refused (an audit hook: weights-only loads and
torch's own readers never ask for a global). A node that calls anything but an operator is
refused by torch's own verifier. Each refusal is a 400 that names the file and the reason.
"""
from __future__ import annotations

import ast
import functools
import json
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from ..protocol.errors import InvalidArgument

_AOTINDUCTOR_DIR = "data/aotinductor/"
_guard = threading.local()          # .refused: the globals an unpickling asked for, while loading
_hook_lock = threading.Lock()
_hook_installed = False


class _UnpicklingRefused(Exception):
    pass


def load_program(path: Path, model: str, version: int):
    """The ExportedProgram in ``path``, or InvalidArgument naming the file and why."""
    import torch
    where = f"model '{model}' version {version}: '{path.name}'"
    _install_hook()
    _guard.refused = refused = []
    # one open file: what is checked is what torch reads, even if the path is replaced meanwhile
    try:
        with open(path, "rb") as f:
            _check_archive(f, where)
            f.seek(0)
            program = torch.export.load(f)
    except InvalidArgument:
        raise
    except Exception as err:
        if refused:
            raise _pickle_refusal(where, refused) from None
        raise InvalidArgument(f"{where} is not a program saved by torch.export.save: "
                              f"{_last_line(err)}") from None
    finally:
        _guard.refused = None
    if refused:         # an unpickling torch caught and went on from: nothing of it ran
        raise _pickle_refusal(where, refused)
    return program


# ---- before: the archive --------------------------------------------------------------------

def _check_archive(f: BinaryIO, where: str) -> None:
    for name, read in _members(f):
        if name.startswith(_AOTINDUCTOR_DIR):
            raise InvalidArgument(
                f"{where}: refused, the archive holds AOTInductor compiled code ({name}), which "
                f"would be loaded into the server process; save the exported program alone "
                f"(torch.export.save)")
        if not name.endswith(".json"):
            continue
        try:
            document = json.loads(read())
        except Exception:     # unreadable, or not a program: torch refuses it or never reads it
            continue
        for expr in _expressions(document):
            if not _is_sympy_literal(expr):
                raise InvalidArgument(
                    f"{where}: refused, the shape expression {expr[:200]!r} in {name} is not "
                    f"made of sympy constructors and literals (torch would eval it here)")


def _members(f: BinaryIO) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(name, read) of each member, as torch reads the archive: its PT2 reader (names below
    the archive's folder) and, for the older format, zipfile."""
    import torch
    try:
        reader = torch._C.PyTorchFileReader(f)
        names = list(reader.get_all_records())
    except Exception:   # not a PT2 archive: torch.export.load goes on to the older format
        names = []
    for name in names:
        yield name, functools.partial(reader.get_record, name)
    try:
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            for name in archive.namelist():
                yield name, functools.partial(archive.read, name)
    except (zipfile.BadZipFile, OSError):
        return


def _expressions(node: Any):
    """Every ``expr_str`` (a sympy expression torch parses with sympify) in a program's JSON."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "expr_str" and isinstance(value, str):
                    yield value
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _is_sympy_literal(text: str) -> bool:
    """sympy's ``srepr`` (``Add(Symbol('s0', integer=True), Integer(1))``) or ``str`` form
    (``s0 + 1``): calls of sympy classes, numbers, symbol names and arithmetic, nothing that
    sympify's eval could turn into other code."""
    try:
        return _literal(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):   # deep nesting: refused
        return False


_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub,
              ast.UAdd, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt,
              ast.GtE, ast.BitAnd, ast.BitOr)
_STRING_ARGUMENT = {"Symbol", "Dummy", "Float"}      # their first argument is a name or digits


def _literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool)) or node.value is None
    if isinstance(node, ast.Name):
        return _sympy_name(node.id) is not None
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, _OPERATORS) and _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _OPERATORS) and _literal(node.left) and _literal(node.right)
    if isinstance(node, ast.BoolOp):
        return isinstance(node.op, _OPERATORS) and all(_literal(v) for v in node.values)
    if isinstance(node, ast.Compare):
        return (all(isinstance(op, _OPERATORS) for op in node.ops)
                and all(_literal(v) for v in (node.left, *node.comparators)))
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or _sympy_name(node.func.id) != "class":
            return False
        for i, arg in enumerate(node.args):
            text_ok = (i == 0 and node.func.id in _STRING_ARGUMENT and isinstance(arg, ast.Constant)
                       and isinstance(arg.value, str))
            if not (text_ok or _literal(arg)):
                return False
        return all(k.arg is not None and isinstance(k.value, ast.Constant)
                   and not isinstance(k.value.value, str) for k in node.keywords)
    return False


def _sympy_name(name: str) -> str | None:
    """"class" for a sympy class (torch's sympy functions first, as sympify's locals are),
    "value" for a sympy constant, "symbol" for a free name sympify makes a Symbol of; None for
    anything else it would resolve (a builtin, a sympy function that is not an expression)."""
    import builtins

    import sympy
    import torch.utils._sympy.functions as torch_functions
    for namespace in (torch_functions, sympy):
        found = getattr(namespace, name, None)
        if found is not None:
            if isinstance(found, type) and issubclass(found, sympy.Basic):
                return "class"
            return "value" if isinstance(found, sympy.Basic) else None
    if name.startswith("_") or hasattr(builtins, name):
        return None
    return "symbol"


# ---- while: no unpickling -------------------------------------------------------------------

def _install_hook() -> None:
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            sys.addaudithook(_refuse_unpickling)
            _hook_installed = True


def _refuse_unpickling(event: str, args: tuple) -> None:
    # pickle.find_class: every global a pickle names (the callable of a __reduce__ included);
    # torch's weights-only unpickler has its own allow-list and never asks for one
    if event == "pickle.find_class":
        refused = getattr(_guard, "refused", None)
        if refused is not None:
            refused.append(f"{args[0]}.{args[1]}")
            raise _UnpicklingRefused(f"unpickling {args[0]}.{args[1]} refused")


def _pickle_refusal(where: str, refused: list[str]) -> InvalidArgument:
    return InvalidArgument(
        f"{where}: refused, loading it would unpickle Python objects (first: {refused[0]}); the "
        f"server loads programs whose weights and constants are tensors saved by "
        f"torch.export.save, and never unpickles a model file's objects")


def _last_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__
