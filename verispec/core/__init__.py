"""The step both front doors share (the library's engine and the server's scheduler) and what it reports."""

from verispec.core.step_record import RowStep, StepRecord

__all__ = ["RowStep", "StepRecord"]
