"""One error type for input that cannot be built, so every entry point can print it as one line."""


class ConfigError(ValueError):
    """A configuration or request that cannot be built.

    The message always names the field, the value and what would work, e.g.
    ``ctx.tp=3: 8 kv heads cannot be split or duplicated over 3 ranks; use a divisor or multiple of 8``.
    """

    def __init__(self, field: str, value, hint: str):
        self.field, self.value, self.hint = field, value, hint
        super().__init__(f"{printable(field)}={printable(value)}: {hint}")


def printable(value) -> str:
    """``value`` as a one-line error shows it: escaped where it holds a control or line-separator character, which
    would break the one line."""
    shown = str(value)
    return shown if shown.isprintable() else shown.encode("unicode_escape").decode("ascii")


def require(cond: bool, field: str, value, hint: str) -> None:
    if not cond:
        raise ConfigError(field, value, hint)


def positive(field: str, value) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
            field, value, "must be a positive integer")


def install_hint(extra: str, what: str) -> str:
    """The one wording of a missing optional package: what is missing and the extra that brings it
    (pyproject.toml's ``[project.optional-dependencies]``), as the install commands of the docs write it."""
    return f"{what} is not installed; pip install -e \".[{extra}]\" (the {extra} extra)"


def _warning_line(message, category, filename, lineno, line=None) -> str:
    return f"kvlab: warning: {message} ({category.__name__})\n"


def one_line_warnings() -> None:
    """Python warnings in one line each, like kvlab's errors: not the file, line number and source line of
    the call that warned (noise to whoever runs kvlab, and a second line that breaks 'one line a problem')."""
    import warnings

    warnings.formatwarning = _warning_line
    quiet_user_searchpath()


def quiet_user_searchpath() -> None:
    """The user's config directory (conf/config.yaml's hydra.searchpath: cost profiles) is optional: without it
    there is nothing to find there, and no warning to give."""
    import warnings

    warnings.filterwarnings("ignore", message=r"provider=hydra.searchpath in main, path=.*kvlab is not available")
