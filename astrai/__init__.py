"""The `astrai` command line (astrai/cli.py) and the team services it starts (astrai/services.py)."""
