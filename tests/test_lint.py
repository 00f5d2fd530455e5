"""ruff (configured in pyproject.toml) finds nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency ([test] extra)"
    res = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
