"""The job's schema (schema.py) and reading a job file (parse.py). Everything below job/ that reads a setting
imports it from here."""

from batchgen.config.schema import (JobSampling, JobSpec, LimitsSpec, ModelSpec, OutputSpec, PromptSpec,
                                    ReasoningSpec, SourceSpec)

__all__ = ["JobSampling", "JobSpec", "LimitsSpec", "ModelSpec", "OutputSpec", "PromptSpec", "ReasoningSpec",
           "SourceSpec"]
