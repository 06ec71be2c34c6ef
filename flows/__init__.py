"""The Prefect flows that chain the stages (flows/pipeline.py). The `astrai` command line is in astrai/cli.py."""
