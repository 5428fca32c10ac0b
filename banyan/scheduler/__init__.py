from banyan.scheduler.request import FinishReason, Request, RequestUpdate
from banyan.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["FinishReason", "Request", "RequestUpdate", "Scheduler", "SchedulerConfig"]
