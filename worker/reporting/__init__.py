"""What a run tells the world: the service's callbacks, metrics, experiment trackers, logs,
failure messages, and where its ranks were placed."""
