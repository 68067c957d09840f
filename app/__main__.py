"""`python -m app` is the `tuneyard` command."""

from app.cli import main

main()
