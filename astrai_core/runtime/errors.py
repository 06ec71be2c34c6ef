class AstraiError(Exception):
    """Bad user input (a file, a line, a key). The CLI prints the message on one line and exits non-zero."""


class TrainingError(AstraiError, RuntimeError):
    """Training cannot go on (a non-finite loss, a failed rank): the message is the one line the user sees."""
