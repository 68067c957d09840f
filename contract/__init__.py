"""The run contract, shared by the service (app/) and the worker (worker/): the request,
the rules both sides apply to its data, and how its steps are counted. Torch-free."""
