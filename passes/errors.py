"""Errors a user can cause. The CLI prints them as one line and exits with `exit_code`."""


class LnfoldError(Exception):
    """Bad input or an impossible request: one clear line, exit code 2."""

    exit_code = 2


class NothingToFold(LnfoldError):
    """The model has no LayerNorm, or none that can be folded."""


class VerificationError(LnfoldError):
    """The folded model does not compute what the original does: refuse it (exit code 1)."""

    exit_code = 1


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), at most 200
    characters: what a one-line error can quote of a library's failure."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]
