"""The dead-code check: vulture over the package, benchmarks and tests (config in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_vulture_finds_no_unused_code():
    done = subprocess.run([sys.executable, "-m", "vulture"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, "unused code (remove it, or list it with its reason in .ci/vulture_whitelist.py):\n" \
        + done.stdout + done.stderr


def test_vulture_would_report_an_unused_function(tmp_path):
    (tmp_path / "m.py").write_text("def used():\n    return 1\n\n\ndef forgotten():\n    return 2\n\n\nused()\n")
    done = subprocess.run([sys.executable, "-m", "vulture", "m.py", "--min-confidence", "60"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "forgotten" in done.stdout
