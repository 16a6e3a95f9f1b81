"""User-facing errors: anything a user can fix (job file, input data, paths, knobs) raises JobError.

The CLI prints its message (one actionable paragraph) and exits non-zero without a traceback."""


class JobError(Exception):
    """A problem the user can fix; the message says what and how."""


class RowError(Exception):
    """A row that cannot be generated; it goes to rejects/ with `error_class` and the message."""

    def __init__(self, error_class: str, message: str) -> None:
        super().__init__(message)
        self.error_class = error_class
