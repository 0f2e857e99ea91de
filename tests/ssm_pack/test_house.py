"""The house rule: ``ssm_pack`` is the ground floor and never imports ``mixers``."""

import ast
import pathlib
import subprocess
import sys

import ssm_pack

PACKAGE = pathlib.Path(ssm_pack.__file__).parent


def _imports_of(path: pathlib.Path) -> set[str]:
    """Every module name an import statement of ``path`` names (absolute or relative-resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_module_of_ssm_pack_imports_mixers():
    offenders = {path.name: sorted(n for n in _imports_of(path) if n.split(".")[0] == "mixers")
                 for path in sorted(PACKAGE.rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) > 15                       # the walk really saw the package


def test_importing_every_module_of_ssm_pack_loads_no_mixers():
    modules = [".".join(("ssm_pack",) + p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
               for p in sorted(PACKAGE.rglob("*.py")) if p.stem != "__main__"]
    assert "ssm_pack.formats.params" in modules and "ssm_pack.support" in modules     # the subpackages too
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mixers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_walk_sees_an_upward_import(tmp_path):
    """Negative control: the AST walk finds a planted ``from mixers...`` import."""
    planted = tmp_path / "bad.py"
    planted.write_text("import torch\nfrom mixers.ops import dispatch\n")
    assert "mixers.ops" in _imports_of(planted)
