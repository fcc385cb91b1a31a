"""`CliError`: the one error type of the `dist-quant` command line (plain Python, no torch)."""


class CliError(Exception):
    """A one-line error for the user, with the exit code to return."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code
