"""Requests, sampling parameters, the unified-budget Scheduler and its policies. No torch."""

from scheduling.config import SchedulerConfig
from scheduling.output import (
    CachedRequestData,
    NewRequestData,
    RequestOutput,
    RunnerOutput,
    SchedulerOutput,
    StepShape,
    StepStats,
    TenantTokens,
)
from scheduling.policy import (
    ACCEPT,
    DEFER,
    POLICY_API_VERSION,
    Admission,
    BasePolicy,
    Decision,
    LoadView,
    Policy,
    reject,
)
from scheduling.request import DEFAULT_TENANT, SLO, Request, RequestStatus
from scheduling.sampling_params import SamplingParams, SamplingParamsError
from scheduling.scheduler import QueueFullError, Scheduler
from scheduling.spec_stats import SpecDecodeStats

__all__ = [
    "ACCEPT",
    "DEFAULT_TENANT",
    "DEFER",
    "POLICY_API_VERSION",
    "SLO",
    "Admission",
    "BasePolicy",
    "CachedRequestData",
    "Decision",
    "LoadView",
    "NewRequestData",
    "Policy",
    "QueueFullError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RunnerOutput",
    "SamplingParams",
    "SamplingParamsError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SpecDecodeStats",
    "StepShape",
    "StepStats",
    "TenantTokens",
    "reject",
]
