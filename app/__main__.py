"""`python -m app` is the `tuneyard` command."""

from app.cli.commands import main

main()
