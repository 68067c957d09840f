"""The Ray side of the service (app/cluster/)."""
