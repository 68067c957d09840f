"""The request rules (app/services/rules/)."""
