"""The low layers import one way: core → ops → models → executor (README's Layout table).

Every import is read from the source (function-local ones too, which a lazy import would otherwise hide), so
a new upward import fails here rather than as an import cycle in some later change.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pagedgen"
ORDER = ("core", "ops", "models", "executor")  # each may import only those before it
SHARED = {"errors"}  # pagedgen.errors: exception types every layer raises; it imports nothing from pagedgen


def pagedgen_imports(path: Path) -> set[str]:
    """The pagedgen subpackages or top-level modules a file imports, e.g. ``{"core", "errors"}``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "pagedgen":  # from pagedgen import ops
                modules = [f"pagedgen.{alias.name}" for alias in node.names]
        else:
            assert not isinstance(node, ast.ImportFrom), f"{path}: relative import"
            continue
        found.update(m.split(".")[1] if "." in m else "" for m in modules if m.split(".")[0] == "pagedgen")
    return found


def imports_of(package: str) -> dict[str, set[str]]:
    """File (relative to pagedgen/) → the other pagedgen parts it imports."""
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files, f"no sources under pagedgen/{package}"
    return {str(f.relative_to(PACKAGE)): pagedgen_imports(f) - {package} for f in files}


@pytest.mark.parametrize("package", ORDER)
def test_a_layer_imports_only_the_layers_below_it(package):
    allowed = set(ORDER[: ORDER.index(package)]) | SHARED
    upward = {file: sorted(parts - allowed) for file, parts in imports_of(package).items() if parts - allowed}
    assert upward == {}


def test_shared_modules_import_nothing_from_pagedgen():
    for name in SHARED:
        assert pagedgen_imports(PACKAGE / f"{name}.py") == set(), name


def test_the_import_reader_sees_lazy_and_package_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "import os\nimport pagedgen.ops.gemm\nfrom pagedgen import models\n"
        "def f():\n    from pagedgen.executor.inputs import pack_step\n"
    )
    assert pagedgen_imports(source) == {"ops", "models", "executor"}
