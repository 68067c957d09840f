"""The rules a request is checked by before anything is stored: each module one rule, named
for what it checks."""
