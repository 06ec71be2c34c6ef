class AstraiError(Exception):
    """Bad user input (a file, a line, a key). The CLI prints the message on one line and exits non-zero."""


class TrainingError(AstraiError, RuntimeError):
    """Training cannot go on (a non-finite loss, a failed rank): the message is the one line the user sees."""


class Interrupted(Exception):
    """Ctrl-C (SIGINT) stopped the run; what it started is stopped. The CLI prints one line and exits 130. (Not a
    KeyboardInterrupt inside a Prefect flow's result: Prefect re-raises it in its event-loop thread, which dies.)"""
