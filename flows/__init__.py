"""Prefect flows that chain the stages, and the `astrai` command line."""
