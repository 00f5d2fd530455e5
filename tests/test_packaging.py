"""The repo root is the vserve package: pyproject's explicit package list matches the folders."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package_folders() -> set[str]:
    found = {"vserve"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0].startswith(".") or rel.parts[0] in ("build", "tests", "docs")):
            continue
        if rel.parts:
            found.add("vserve." + ".".join(rel.parts))
    return found


def test_pyproject_packages_match_folders():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["tool"]["setuptools"]["package-dir"] == {"vserve": "."}
    assert set(cfg["tool"]["setuptools"]["packages"]) == _package_folders()


def test_no_stray_python_files_at_root():
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py"]


def test_every_code_folder_is_a_package():
    for folder in ("cli", "core", "kernels", "core/layers", "core/models"):
        assert (ROOT / folder / "__init__.py").exists(), folder


def test_the_checkout_root_does_not_shadow_installed_packages():
    """Run in a checkout's root (`python -c`, `python -m`), the root is on sys.path and its folders (kernels/, core/,
    ...) would import as top-level packages, e.g. in place of the `kernels` distribution transformers >= 5.25
    imports. Importing vserve takes the root off the path."""
    code = ("import importlib.util, vserve; s = importlib.util.find_spec('kernels'); "
            "print(s.origin if s else None)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert str(ROOT / "kernels") not in res.stdout, res.stdout
