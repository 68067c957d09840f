"""The command line (`tuneyard`): its commands, how it renders runs, the REST client it and
the demo use, and the demo with the tiny model and data it builds."""
