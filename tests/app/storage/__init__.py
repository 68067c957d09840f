"""The database and the paths to it (app/storage/)."""
