"""Pipeline stages. Each module holds one stage as a plain function (callable without Prefect or DVC)."""
