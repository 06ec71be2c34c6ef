"""The `astrai` command line (astrai/cli.py) and the environment every entry point sets first (astrai/env.py)."""
