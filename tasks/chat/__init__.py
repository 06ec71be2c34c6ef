"""The chat data's parts: the records' schema and validation (records), the corpus's plays as speeches (plays) and
the demo's chat tasks made from them (demo_tasks)."""
