"""The command line (app/cli/)."""
