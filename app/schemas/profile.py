"""`POST /v1/runs/validate`'s body, and the profile it may answer with: a few real steps of
the request measured on the cluster (app/services/profiles.py)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from contract.run_request import RunRequest

# The first steps of a profile are not timed: they allocate lazily, build DeepSpeed's JIT
# ops and warm caches, which the rest of a run does not do again.
DEFAULT_PROFILE_STEPS = 4
MIN_PROFILE_STEPS = 2
MAX_PROFILE_STEPS = 50


def warmup_steps(steps: int) -> int:
    """One untimed step of a short profile, two of a longer one: at least one is timed."""
    return 1 if steps < DEFAULT_PROFILE_STEPS else 2


class ValidateRequest(RunRequest):
    """A run request, and whether to measure it on the cluster too. Its own model, so that
    `POST /v1/runs` keeps refusing these fields as unknown."""

    profile: bool = Field(
        default=False,
        description="Also run a few real steps of the request on the cluster and report "
        "measured step time, throughput, peak memory per worker, the run's estimated wall "
        "time and cost. Takes as long as loading the model and the steps (tens of seconds "
        "on a small model); nothing is stored, and the cluster is left as it was.",
    )
    profile_steps: int = Field(
        default=DEFAULT_PROFILE_STEPS,
        ge=MIN_PROFILE_STEPS,
        le=MAX_PROFILE_STEPS,
        description="Steps the profile trains; the first (two, from 4 steps on) are warm-up "
        "and not timed.",
    )

    def run_request(self) -> RunRequest:
        """The run request alone, as `POST /v1/runs` would take it: what was left out
        stays left out (rules read that: a priority the key's default decides, a tracking
        name a key's prefix gives; app/services/queue.py, tracking_rules.py)."""
        return RunRequest.model_validate(
            self.model_dump(
                mode="json", exclude={"profile", "profile_steps"}, by_alias=True, exclude_unset=True
            )
        )


class WorkerProfile(BaseModel):
    rank: int
    node_id: str | None = Field(default=None, description="The Ray node the rank ran on")
    peak_device_memory_bytes: int | None = Field(
        description="torch.cuda.max_memory_allocated on the rank's GPU; null on CPU"
    )
    peak_host_memory_bytes: int = Field(
        description="The rank's process's peak resident set (max RSS), loading included"
    )


class ProfileError(BaseModel):
    code: str = Field(
        description="`training_error` (the request's own model, data or memory), "
        "`unplaceable`, `cluster_busy` (other runs hold the resources now), `cluster_error`, "
        "`profile_timeout` (TUNEYARD_PROFILE_TIMEOUT_S), `profile_failed` (the job ended "
        "without a result), `ray_unavailable`"
    )
    message: str


class ProfileView(BaseModel):
    """What a profile measured, or why it could not; every measurement is null on error."""

    steps: int = Field(description="Steps trained, warm-up included")
    warmup_steps: int = Field(description="The first steps, trained but not timed")
    steps_measured: int | None = None
    step_time_seconds: float | None = Field(
        default=None,
        description="Mean wall time of a measured step (each step the slowest rank's)",
    )
    tokens_per_second: float | None = Field(
        default=None, description="Input tokens of all ranks per second of measured steps"
    )
    samples_per_second: float | None = None
    startup_seconds: float | None = Field(
        default=None,
        description="From the job's start to the first step: placing the workers, loading "
        "tokenizer, data and model, DeepSpeed's initialize",
    )
    workers: list[WorkerProfile] = Field(default_factory=list)
    total_steps: int | None = Field(
        default=None, description="The run's steps, as `resolved.total_steps` counts them"
    )
    estimated_total_seconds: float | None = Field(
        default=None,
        description="startup_seconds + step_time_seconds x total_steps: the run's wall time "
        "without its evaluations, checkpoints and export; null when total_steps is unknown",
    )
    gpus: int | None = Field(default=None, description="GPUs the run holds (0 on CPU)")
    estimated_cost: float | None = Field(
        default=None,
        description="TUNEYARD_GPU_HOUR_PRICE x gpus x estimated_total_seconds / 3600; 0 for a "
        "CPU-only run; null when the service has no price or the wall time is unknown",
    )
    currency: str | None = Field(default=None, description="The currency of estimated_cost")
    error: ProfileError | None = Field(
        default=None,
        description="Why the profile could not measure the request; the static checks passed",
    )
