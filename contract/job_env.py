"""The environment variables through which the dispatcher hands one attempt to its worker."""

# The attempt's RunSpec as JSON (contract/run_request.py).
SPEC_ENV = "TUNEYARD_RUN_SPEC"
# The attempt's own callback token: good for this run and attempt only.
TOKEN_ENV = "TUNEYARD_RUN_TOKEN"
# Where the service listens for the worker's callbacks, as the cluster reaches it.
CALLBACK_URL_ENV = "TUNEYARD_CALLBACK_URL"
