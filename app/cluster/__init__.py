"""The Ray side of the service: submitting and reading jobs, the local head, what the
cluster's nodes hold and use, and the dispatcher that starts queued runs on it."""
