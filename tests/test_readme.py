"""The README's set-up commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fenced_after(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(marker):]
    block = after.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip()


def test_ci_runs_the_readme_test_command():
    ci_cmd = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert _fenced_after("<!-- test-command -->") == ci_cmd


def test_main_job_command_needs_no_model_argument():
    cmd = _fenced_after("<!-- main-command -->")
    assert cmd.startswith("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0")
    assert cmd.endswith('.venv/bin/vserve generate "The capital of France is"')
