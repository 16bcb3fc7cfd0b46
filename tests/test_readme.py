"""The README's commands work as written: every `harts ...` line of its shell blocks runs in a fresh folder
and exits 0 (install and test-suite lines are the environment this test runs in, so they are left out)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_commands() -> list[str]:
    commands = []
    # fences alternate open/close; only shell blocks (no language, or bash) hold commands
    for language, block in re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), re.M | re.S):
        if language not in ("", "bash"):
            continue
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("harts "):
                    commands.append(part)
    return commands


def test_the_readme_has_the_commands_users_run():
    commands = readme_commands()
    for name in ("demo", "gen", "compile", "ir", "lower", "verify"):
        assert any(c.startswith(f"harts {name}") for c in commands), name


@pytest.mark.slow
def test_readme_commands_run_verbatim(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for command in readme_commands():
        run = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
        assert "Traceback" not in run.stderr, command
