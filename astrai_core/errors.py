class AstraiError(Exception):
    """Bad user input (a file, a line, a key). The CLI prints the message on one line and exits non-zero."""
