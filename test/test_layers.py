"""The layers import downwards only: geir core < target_npu < kernels < runtime < passes < session <
frontends < tools, bench (spec section 6). Every `geir.*` import of every module is checked, the
ones inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> (installed package, layer); geir/ is the core under every other layer
LAYERS = {
    "geir": ("geir", 0),
    "target_npu": ("geir.target_npu", 1),
    "kernels": ("geir.kernels", 2),
    "runtime": ("geir.runtime", 3),
    "passes": ("geir.passes", 4),
    "session": ("geir.session", 5),
    "frontends": ("geir.frontends", 6),
    "tools": ("geir.tools", 7),
    "bench": ("bench", 8),
    "examples": ("examples", 8),
}
ORDER = [name for name, _ in sorted(LAYERS.items(), key=lambda kv: kv[1][1])]


def layer_of_import(module: str) -> tuple[str, int] | None:
    """The layer a `geir.*` module name belongs to (None for anything outside geir)."""
    if module != "geir" and not module.startswith("geir."):
        return None
    best = ("geir", 0)
    for folder, (package, level) in LAYERS.items():
        if package.startswith("geir") and (module == package or module.startswith(package + ".")):
            if len(package) > len(LAYERS[best[0]][0]):
                best = (folder, level)
    return best


def geir_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `geir.*` import in a file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from geir import ops` imports geir.ops; `from geir.x import y` imports geir.x (or geir.x.y)
            out += [(node.lineno, f"{node.module}.{alias.name}" if node.module == "geir" else node.module)
                    for alias in node.names]
    return [(line, m) for line, m in out if layer_of_import(m) is not None]


def sources() -> list[tuple[str, Path]]:
    return [(folder, p) for folder in LAYERS for p in sorted((ROOT / folder).rglob("*.py"))]


def test_layer_map_covers_every_package_of_the_install():
    text = (ROOT / "pyproject.toml").read_text()
    for folder, (package, _) in LAYERS.items():
        if package.startswith("geir."):
            assert f'"{package}" = "{folder}"' in text, package


def test_the_walk_finds_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom geir.kernels import KERNELS\ndef g():\n    from geir.passes.tile import tile_op\n")
    assert geir_imports(f) == [(2, "geir.kernels"), (4, "geir.passes.tile")]
    assert layer_of_import("geir.passes.tile") == ("passes", 4) and layer_of_import("geir.ir") == ("geir", 0)


@pytest.mark.parametrize("folder, path", sources(), ids=lambda x: str(x.relative_to(ROOT)) if isinstance(x, Path) else x)
def test_imports_run_downwards(folder: str, path: Path):
    level = LAYERS[folder][1]
    upward = [f"{path.relative_to(ROOT)}:{line}: imports {m} ({layer_of_import(m)[0]}, above {folder})"
              for line, m in geir_imports(path) if layer_of_import(m)[1] > level]
    assert not upward, "\n".join(upward) + f"\nlayer order: {' < '.join(ORDER)}"
