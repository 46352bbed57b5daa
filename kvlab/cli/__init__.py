"""The command line and the launching of ranks: ``kvlab run|plan|link|sim`` (``commands``, ``run_cmd``,
``plan_cmd``, ``link_cmd``), the local launcher (``launch``) and the rank's entry point (``worker``,
``python -m kvlab.cli.worker``). Imports kvlab.sim and every layer below."""


def main(argv: list[str] | None = None) -> None:
    """The ``kvlab`` command (``[project.scripts]``). Imported here only when called: a rank's
    ``python -m kvlab.cli.worker`` loads this package and must not pay for the whole command line."""
    from kvlab.core.streams import guard

    guard()  # a closed or full stdout does not fail a run (kvlab.core.streams)
    from kvlab.cli.commands import main as commands_main

    if argv is None:  # the process's own command line: the process ends with it, and a signal is its one line
        from kvlab.core.interrupt import ends_with_command, outermost

        ends_with_command()
        outermost(lambda: commands_main(argv))
    else:
        commands_main(argv)
