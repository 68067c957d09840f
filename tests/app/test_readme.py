"""The README is the contract a new team reads first: keep it true to the code."""

from __future__ import annotations

import re
from pathlib import Path

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_setting_is_documented() -> None:
    prefix = Settings.model_config["env_prefix"]
    missing = [
        f"{prefix}{name.upper()}"
        for name in Settings.model_fields
        if f"`{prefix}{name.upper()}`" not in README
    ]
    assert not missing, f"settings missing from README.md: {missing}"


def test_the_first_two_commands_are_demo_and_test_and_ci_runs_the_test_one() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1].strip() == "make test"


def test_every_cli_command_is_in_the_tour() -> None:
    from app.cli.commands import app

    names = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    missing = [n for n in names if f"tuneyard {n}" not in README]
    assert not missing, f"CLI commands missing from README.md: {missing}"
