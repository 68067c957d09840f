"""The e2e modules in two lanes that run side by side, each on one pytest-xdist process.

A lane's process starts its own session service and Ray head (`service` in conftest.py is
per process), so the two lanes' runs overlap: one run's start-up (mostly single-threaded
imports and actor launches) fills the other's idle core. The lanes are balanced by their
time on a 2-core machine (the runs each module submits, the clusters it starts); a module
missing here runs in the first lane. `make test` runs the e2e half on its own, after the
rest (the Makefile says why); in a session that runs both, every other test is a unit of
its own, sent to whichever process is free.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from xdist.scheduler import LoadScopeScheduling

LANES: dict[str, tuple[str, ...]] = {
    # About 31 runs on the session service (GRPO's sample 8 completions of up to 256 tokens).
    "e2e-a": (
        "test_documented_examples.py",
        "test_defaults.py",
        "test_fault_tolerance.py",
        "test_gpu_check_sides.py",
        "test_profile.py",
        "test_walking_skeleton.py",
    ),
    # About 25 runs. The own-cluster tests (`make test-own-clusters`) run here when selected.
    "e2e-b": (
        "test_dashboard.py",
        "test_runs_that_watch_themselves.py",
        "test_fine_tune_methods.py",
        "test_openai_sdk.py",
        "test_training_modes.py",
        "test_loss_normalisation.py",
        "test_lifecycle.py",
        "test_one_rank_fails.py",
        "test_placement.py",
        "test_remote_cluster_postgres.py",
        "test_serve_workers.py",
        "test_several_nodes.py",
        "test_shared_cluster.py",
    ),
}


E2E_FOLDER = PurePosixPath("tests/e2e")
FIRST_LANE = next(iter(LANES))


class LaneScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduling, where a scope is an e2e lane or a single test.

    Scopes go out largest first (the lanes), and a process gets a new scope only when two
    or fewer of its tests are left, so each lane starts at once on a process of its own and
    runs in collection order there (its modules' fixtures hold). (xdist's own
    `--dist loadgroup` cannot do this under pytest 9.2: it regroups tests by rewriting a
    node id pytest no longer reads.)"""

    def _split_scope(self, nodeid: str) -> str:
        module = PurePosixPath(nodeid.split("::", 1)[0])
        if module.parent != E2E_FOLDER:
            return nodeid
        return next((lane for lane, names in LANES.items() if module.name in names), FIRST_LANE)
