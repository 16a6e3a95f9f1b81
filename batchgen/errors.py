"""User-facing errors: anything a user can fix (job file, input data, paths, knobs) raises JobError.

The CLI prints its message (one actionable paragraph) and exits non-zero without a traceback."""


class JobError(Exception):
    """A problem the user can fix; the message says what and how."""
