"""The package's shape: no import cycle between its modules (tools/import_cycles.py, imports
under ``if TYPE_CHECKING:`` counted) and no module past 800 lines."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jupyter_triton"
MAX_LINES = 800


def _import_cycles():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_counts_type_checking_imports_and_not_ancestors(tmp_path):
    ic = _import_cycles()
    package = _write(tmp_path, {
        "pkg/__init__.py": "from .low import Low\n",
        # low names high only for a type: still a cycle a reader follows
        "pkg/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from .high import High\nclass Low: ...\n",
        "pkg/high.py": "from .low import Low\nclass High: ...\n",
        # a module importing its own package (whose __init__ imports it back): not a cycle
        "pkg/sub/__init__.py": "from .leaf import leaf\n",
        "pkg/sub/leaf.py": "from .. import sub\nimport pkg.sub\ndef leaf(): ...\n",
    })
    assert ic.cycles(ic.graph(package)) == [["pkg.high", "pkg.low"]]


def test_no_import_cycles():
    ic = _import_cycles()
    assert ic.cycles(ic.graph(PACKAGE)) == []


def test_no_module_over_800_lines():
    # lines as ``wc -l`` counts them: newlines
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := p.read_bytes().count(b"\n")) > MAX_LINES}
    assert long == {}
